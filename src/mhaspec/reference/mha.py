"""The float64 reference: one small pure function per stage of docs/spec.md §2.

Dataflow (axis legend in :mod:`mhaspec.spec.config`)::

    query (B,T,d_model) ─project─► q_proj (B,T,H·D) ─split─► Q (B,H,T,D) ─┐
    key   (B,S,kdim)    ─project─► k_proj (B,S,G·D) ─split─► K (B,G,S,D) ─┴─► scores (B,H,T,S)
                                                                                  │ softmax over S of the visible entries
    value (B,S,vdim)    ─project─► v_proj (B,S,G·E) ─split─► V (B,G,S,E) ─┐   attn_weights (B,H,T,S)
                                                                          └─► head_outputs (B,H,T,E)
                        concat (B,T,H·E) ◄─merge─┘ ─output_projection─► output (B,T,d_out)

Query head h reads key/value head g(h) = h // (H / G).

Numerical choices, each for byte-identical fixtures on every machine:

* Every sum of products is ``math.fsum`` of the (correctly rounded) products:
  a correctly rounded sum, independent of BLAS, thread count and summation
  order.  With the catalog's dyadic inputs the projections are exact.
* ``exp`` is evaluated by :mod:`decimal`, whose ``exp`` is correctly rounded,
  then rounded once to float64; numpy's and libm's ``exp`` differ in the last
  bit between platforms.
* The softmax subtracts the row maximum of the visible scores before ``exp``
  (no overflow for any finite score) and sums with ``fsum``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Context, Decimal

import numpy as np

from ..spec import MHAConfig
from ..spec.masks import visibility  # (B, H, T, S): causal AND window AND mask, the one rule (spec/masks.py)

_EXP_CONTEXT = Context(prec=40)


def _matmul(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``a @ b (+ bias)`` with each dot product summed exactly-rounded by ``math.fsum``.

    a (..., n, k), b (..., k, m), bias (m,) -> (..., n, m).
    """
    products = a[..., :, :, None] * b[..., None, :, :]  # (..., n, k, m)
    products = np.moveaxis(products, -2, -1)  # (..., n, m, k)
    if bias is not None:
        bias_term = np.broadcast_to(bias, products.shape[:-1])[..., None]
        products = np.concatenate([products, bias_term], axis=-1)
    rows = products.reshape(-1, products.shape[-1]).tolist()
    return np.array([math.fsum(r) for r in rows], dtype=np.float64).reshape(products.shape[:-1])


def _exp(x: np.ndarray) -> np.ndarray:
    """Correctly rounded ``exp`` of a float64 array (via decimal)."""
    flat = [float(Decimal(v).exp(_EXP_CONTEXT)) for v in x.ravel().tolist()]
    return np.array(flat, dtype=np.float64).reshape(x.shape)


def project(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """y = x @ w + b.   x (B, L, F), w (F, N), b (N,) or None -> (B, L, N)."""
    return _matmul(x, w, b)


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, L, heads·D) -> (B, heads, L, D); head h owns columns [h·D, (h+1)·D)."""
    B, L, F = x.shape
    return x.reshape(B, L, heads, F // heads).transpose(0, 2, 1, 3)


def repeat_kv(x: np.ndarray, group_size: int) -> np.ndarray:
    """(B, G, S, D) -> (B, G·group_size, S, D) so that query head h reads head h // group_size."""
    return np.repeat(x, group_size, axis=1)


def scores(Q: np.ndarray, K: np.ndarray, scale: float) -> np.ndarray:
    """scale · Q Kᵀ.   Q (B, H, T, D), K (B, H, S, D) -> (B, H, T, S).

    The dot product is summed first and scaled once (one rounding).
    """
    return _matmul(Q, np.swapaxes(K, -1, -2)) * scale


def softmax(s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Softmax over S of the visible scores; invisible entries are 0.

    A row with no visible key is all zeros — never NaN, never uniform.
    s, visible (B, H, T, S) -> (B, H, T, S).
    """
    row_max = np.max(np.where(visible, s, -np.inf), axis=-1, keepdims=True)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # rows with no visible key
    e = np.zeros_like(s)
    e[visible] = _exp(s[visible] - np.broadcast_to(row_max, s.shape)[visible])
    total = np.array([math.fsum(r) for r in e.reshape(-1, e.shape[-1]).tolist()]).reshape(row_max.shape)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def weighted_sum(p: np.ndarray, V: np.ndarray) -> np.ndarray:
    """p @ V.   p (B, H, T, S), V (B, H, S, E) -> (B, H, T, E)."""
    return _matmul(p, V)


def merge_heads(o: np.ndarray) -> np.ndarray:
    """(B, H, T, E) -> (B, T, H·E), heads concatenated in head order."""
    B, H, T, E = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def output_projection(c: np.ndarray, w_o: np.ndarray, b_o: np.ndarray | None) -> np.ndarray:
    """concat @ w_o + b_o.   (B, T, H·E) -> (B, T, d_out)."""
    return _matmul(c, w_o, b_o)


def forward(
    config: MHAConfig, inputs: dict[str, np.ndarray | None], weights: dict[str, np.ndarray],
    seq_lens: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """Every stage of docs/spec.md §2, by name, in float64; with the variants of §2a, in their order
    (projections → RoPE → scale·QKᵀ → softcap → + bias / ALiBi → mask → softmax with sinks → P·V →
    concat → W^O), plus ``q_rot`` and ``k_rot`` with rope and ``lse`` always; ``seq_lens``: a packed case's
    lengths (keys ≥ l_b invisible to entry b, :func:`visibility`)."""
    from . import variants  # beside this module; imported here as it imports _exp from here

    query, key, value = inputs["query"], inputs["key"], inputs["value"]
    assert query is not None and key is not None and value is not None
    (B, T, _), S = query.shape, key.shape[1]
    out: dict[str, np.ndarray] = {}
    # 1. project (and turn), split
    q = project(query, weights["w_q"], weights.get("b_q"))
    k = project(key, weights["w_k"], weights.get("b_k"))
    v = project(value, weights["w_v"], weights.get("b_v"))
    q_att, k_att = q, k
    if config.rope is not None:
        q_pos, k_pos = variants.rope_positions(config, T, S)
        q_att = out["q_rot"] = variants.rope(q, config.H, q_pos, config)
        k_att = out["k_rot"] = variants.rope(k, config.H_kv, k_pos, config)
    Q = split_heads(q_att, config.H)
    K = repeat_kv(split_heads(k_att, config.H_kv), config.group_size)
    V = repeat_kv(split_heads(v, config.H_kv), config.group_size)
    # 2. attend
    s = scores(Q, K, float(config.scale))  # type: ignore[arg-type]
    if config.softcap is not None:
        s = variants.softcap(s, config.softcap)
    bias, slopes = inputs.get("bias"), variants.alibi_slopes(config)
    if bias is not None or slopes is not None:
        s = variants.add_bias(s, bias, slopes, variants.alibi_distance(config, T, S))
    visible = visibility(config, inputs.get("mask"), B, T, S, seq_lens)
    sinks = weights.get("sink_logits") if config.sinks else None
    p = softmax(s, visible) if sinks is None else variants.softmax_with_sinks(s, visible, sinks)
    o = weighted_sum(p, V)
    # 3. concat and project
    c = merge_heads(o)
    y = output_projection(c, weights["w_o"], weights.get("b_o"))
    out.update({
        "q_proj": q, "k_proj": k, "v_proj": v, "scores": s,
        "attn_weights": p, "head_outputs": o, "concat": c, "output": y,
        "lse": variants.lse(s, visible, sinks),
    })
    return out
