"""The float64 backward reference: one small pure function per backward stage.

The loss is ``L = Σ d_output ⊙ output``; every stage is ∂L/∂(stage)
(docs/backward.md).  Dataflow, reverse of :mod:`mhaspec.reference.mha`::

    d_output (B,T,d_out) ─@w_oᵀ─► d_concat (B,T,H·E) ─split─► d_head_outputs dO (B,H,T,E)
        │                                                      ├─ dO Vᵀ ─► d_attn_weights dP (B,H,T,S)
        │                                                      │              │ P ⊙ (dP − Σ_S P⊙dP)
        │                                                      │           d_scores dS (B,H,T,S) ─► d_bias, d_sink_logits
        │                                                      │              │ ⊙ softcap′ (with softcap)
        │                                                      │           d_raw (B,H,T,S)
        │                                                      │              ├─ scale·d_raw K  ─merge─► d_q_proj (RoPE: d_q_rot, turned back)
        │                                                      │              └─ scale·Σ_group d_rawᵀQ ─► d_k_proj (RoPE: d_k_rot, turned back)
        │                                                      └─ Σ_group Pᵀ dO ───────────────────► d_v_proj
        └─ concatᵀ d_output ─► d_w_o,  Σ d_output ─► d_b_o
    d_q_proj ─@w_qᵀ─► d_query,  queryᵀ d_q_proj ─► d_w_q,  Σ d_q_proj ─► d_b_q   (and k, v alike)

Numerical choices, the forward's (byte-identical fixtures on every machine):
every sum of products is one ``math.fsum`` (correctly rounded, independent of
order); a GQA group's sum over its query heads, and self-attention's sum of
the three input gradients, are part of that one ``fsum``, never a sum of
rounded partial sums; the rest are single IEEE operations.
"""

from __future__ import annotations

import numpy as np

from ..spec import INPUT_GRADIENTS, MHAConfig
from .mha import _matmul, merge_heads, scores, split_heads


def _grouped(x: np.ndarray, groups: int) -> np.ndarray:
    """(B, H, L, F) -> (B, G, group·L, F): the rows of a group's query heads stacked, head-major."""
    B, H, L, F = x.shape
    return x.reshape(B, groups, (H // groups) * L, F)


def d_concat(d_output: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """d_output @ w_oᵀ.   (B, T, d_out), (H·E, d_out) -> (B, T, H·E)."""
    return _matmul(d_output, w_o.T)


def d_head_outputs(d_concat: np.ndarray, heads: int) -> np.ndarray:
    """(B, T, H·E) -> (B, H, T, E): the concat's gradient split into heads (no arithmetic)."""
    return split_heads(d_concat, heads)


def d_attn_weights(dO: np.ndarray, V: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """dO @ Vᵀ for the visible weights; 0 where masked (a masked weight is the constant 0).

    dO (B, H, T, E), V (B, H, S, E) (repeated over the group), visible (B, H, T, S) -> (B, H, T, S).
    """
    return np.where(visible, _matmul(dO, np.swapaxes(V, -1, -2)), 0.0)


def softmax_delta(p: np.ndarray, dP: np.ndarray) -> np.ndarray:
    """δ = Σ_S P ⊙ dP per query row, one fsum per row.   p, dP (B, H, T, S) -> (B, H, T, 1)."""
    return _matmul(p[..., None, :], dP[..., :, None])[..., 0]


def d_scores(p: np.ndarray, dP: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """The softmax Jacobian: P ⊙ (dP − δ) with δ = Σ_S P ⊙ dP per query row (:func:`softmax_delta`;
    with sinks too: the sink's value is 0, so it adds nothing to δ).

    Masked entries and rows that see no key are exactly 0 (P is 0 there).
    p, dP, visible (B, H, T, S) -> (B, H, T, S).
    """
    return np.where(visible, p * (dP - softmax_delta(p, dP)), 0.0)


def d_q_heads(dS: np.ndarray, K: np.ndarray, scale: float) -> np.ndarray:
    """scale · dS @ K, summed first and scaled once.   dS (B, H, T, S), K (B, H, S, D) -> (B, H, T, D)."""
    return _matmul(dS, K) * scale


def d_k_heads(dS: np.ndarray, Q: np.ndarray, scale: float, kv_heads: int) -> np.ndarray:
    """scale · Σ_{h in group g} dS_hᵀ Q_h, one sum over the group's (head, query) pairs.

    dS (B, H, T, S), Q (B, H, T, D) -> (B, G, S, D).
    """
    return _matmul(np.swapaxes(_grouped(dS, kv_heads), -1, -2), _grouped(Q, kv_heads)) * scale


def d_v_heads(p: np.ndarray, dO: np.ndarray, kv_heads: int) -> np.ndarray:
    """Σ_{h in group g} P_hᵀ dO_h.   p (B, H, T, S), dO (B, H, T, E) -> (B, G, S, E)."""
    return _matmul(np.swapaxes(_grouped(p, kv_heads), -1, -2), _grouped(dO, kv_heads))


def input_grad(d_ys: list[np.ndarray], ws: list[np.ndarray]) -> np.ndarray:
    """Σ_i d_y_i @ w_iᵀ as one sum (one term: cross-attention; three: self-attention).

    d_y_i (B, L, N_i), w_i (F, N_i) -> (B, L, F).
    """
    return _matmul(np.concatenate(d_ys, axis=-1), np.concatenate(ws, axis=-1).T)


def weight_grad(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """xᵀ d_y summed over B and L.   x (B, L, F), d_y (B, L, N) -> (F, N)."""
    return _matmul(x.reshape(-1, x.shape[-1]).T, d_y.reshape(-1, d_y.shape[-1]))


def bias_grad(d_y: np.ndarray) -> np.ndarray:
    """d_y summed over B and L.   (B, L, N) -> (N,)."""
    rows = d_y.reshape(-1, d_y.shape[-1])
    return _matmul(np.ones((1, rows.shape[0])), rows)[0]


def backward(
    config: MHAConfig,
    inputs: dict[str, np.ndarray | None],
    weights: dict[str, np.ndarray],
    stages: dict[str, np.ndarray],
    visible: np.ndarray,
    d_output: np.ndarray,
    inputs_kind: str = "distinct",
) -> dict[str, np.ndarray]:
    """Every backward stage (docs/backward.md), by name, in float64, from the forward ``stages``
    (with RoPE: ``q_rot`` and ``k_rot`` among them).

    ``inputs_kind`` (``CaseSpec.inputs``): a tensor passed as several inputs gets one
    gradient, the sum of theirs (self-attention: ``d_query``; shared key/value: ``d_key``).
    The variants (:mod:`.variants`): ``d_sink_logits`` with sinks, ``d_bias`` with a ``bias`` input,
    ``d_q_rot`` and ``d_k_rot`` with RoPE (turned back into ``d_q_proj``, ``d_k_proj``); softcap's
    derivative enters between ``d_scores`` and the gradients of Q and K; ALiBi has none.
    """
    from . import variants  # beside this module; imported here as it imports from .mha

    H, G, group = config.H, config.H_kv, config.group_size
    scale = float(config.scale)  # type: ignore[arg-type]
    rotated = config.rope is not None
    Q = split_heads(stages["q_rot" if rotated else "q_proj"], H)  # (B, H, T, D)
    K = np.repeat(split_heads(stages["k_rot" if rotated else "k_proj"], G), group, axis=1)  # (B, H, S, D)
    V = np.repeat(split_heads(stages["v_proj"], G), group, axis=1)  # (B, H, S, E)
    p = stages["attn_weights"]
    # 1. through the output projection and the head merge
    dc = d_concat(d_output, weights["w_o"])
    dO = d_head_outputs(dc, H)
    # 2. through attention (and the variants between the scores and Q, K)
    dP = d_attn_weights(dO, V, visible)
    dS = d_scores(p, dP, visible)
    out = {"d_concat": dc, "d_head_outputs": dO, "d_attn_weights": dP, "d_scores": dS}
    if config.sinks:
        p_sink = variants.sink_weights(stages["scores"], visible, weights["sink_logits"])  # (B, H, T)
        out["d_sink_logits"] = variants.d_sink_logits(p_sink, softmax_delta(p, dP)[..., 0])
    bias = inputs.get("bias")
    if bias is not None:
        out["d_bias"] = variants.d_bias(dS, bias.shape)
    d_raw = dS if config.softcap is None else variants.softcap_back(dS, scores(Q, K, scale), config.softcap)
    dq = merge_heads(d_q_heads(d_raw, K, scale))
    dk = merge_heads(d_k_heads(d_raw, Q, scale, G))
    dv = merge_heads(d_v_heads(p, dO, G))
    if rotated:
        q_pos, k_pos = variants.rope_positions(config, Q.shape[2], K.shape[2])  # (T,), (S,)
        out["d_q_rot"], out["d_k_rot"] = dq, dk
        dq = variants.rope(dq, H, q_pos, config, back=True)
        dk = variants.rope(dk, G, k_pos, config, back=True)
    # 3. through the projections: inputs, weights, biases
    out.update({"d_q_proj": dq, "d_k_proj": dk, "d_v_proj": dv})
    proj = {"q": dq, "k": dk, "v": dv}
    for name, sums in INPUT_GRADIENTS[inputs_kind].items():  # one tensor: the sum of its inputs' gradients
        out[name] = input_grad([proj[n] for n in sums], [weights[f"w_{n}"] for n in sums])
    x = {"q": inputs["query"], "k": inputs["key"], "v": inputs["value"], "o": stages["concat"]}
    d_y = {"q": dq, "k": dk, "v": dv, "o": d_output}
    for n in "qkvo":
        out[f"d_w_{n}"] = weight_grad(x[n], d_y[n])  # type: ignore[arg-type]
    if config.bias:
        for n in "qkvo":
            out[f"d_b_{n}"] = bias_grad(d_y[n])
    return out
