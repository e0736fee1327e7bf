"""The backward stages' local checks: each backward stage recomputed in float64 from the adapter's
*own* previous stages (forward and backward), with only that stage's own rounding as tolerance
(docs/backward.md).  In float16 and bfloat16 the propagated golden bound
(:mod:`.backward`) grows wide, the local one does not, so a wrong formula is caught at its own
stage in every dtype.  A length-n sum of products is allowed ρ(n)·Σ|aᵢ·bᵢ| (``Rounding.rel``).
"""

from __future__ import annotations

import numpy as np

from ...fixtures import GoldenCase
from ...spec import INPUT_GRADIENTS, STAGE
from ...spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from . import backward_variants as bv
from .softmax import softmax_rounding, visible_row_max
from .vocabulary import LINEAR, Rounding, grouped, grouped_t, heads, merge, rounding, swap


def _softmax_recompute(P: np.ndarray, s_abs: np.ndarray, visible: np.ndarray, r: Rounding,
                       sink_abs: np.ndarray | None = None) -> np.ndarray:
    """How far a correct backward's P may be from the forward's returned P, element-wise.

    A backward may reuse the returned weights or recompute them (FlashAttention:
    exp(s − logsumexp)); each is within the softmax's own rounding of the exact
    softmax of the scores — γ_acc(S + k) + u_acc·(|s_j| + max|s|) relative
    (docs/tolerances.md) — so the two are within twice that; under the standard
    contract, plus the storage of P and of the scores it came from (u·(2 + |s_j| + max|s|)).  With sinks
    (``sink_abs``: |z| (1, H, 1, 1)) the row's largest logit may be the sink's: max|s| counts it.
    """
    row_max = visible_row_max(s_abs, visible)
    if sink_abs is not None:
        row_max = np.maximum(row_max, sink_abs)
    rel = 2 * softmax_rounding(s_abs, row_max, r.gamma(P.shape[-1]), r.acc)
    if r.store:
        rel = rel + r.u * (2 + s_abs + row_max)
    return np.where(visible, P * rel, 0.0)


def local_checks(golden: GoldenCase, dtype: str, own: dict[str, np.ndarray], table: ToleranceTable = DEFAULT_TOLERANCES,
                 precision: str = "standard") -> dict[str, tuple[np.ndarray, np.ndarray, tuple[str, ...]]]:
    """``{stage: (float64 recomputation, tolerance, the adapter's stages it came from)}``.

    ``own`` holds the adapter's returned stages (forward and backward) as float64
    arrays of the canonical shapes; a check whose sources are not all there is left out.
    """
    r = rounding(dtype, precision, table)
    floor = r.floor
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)
    S, E, T = golden.spec.src_len, cfg.D_v, golden.spec.tgt_len
    visible = golden.visible
    A = np.abs
    assert golden.d_output is not None
    dY = golden.d_output

    def has(*names: str) -> bool:
        return all(n in own for n in names)

    out: dict[str, tuple[np.ndarray, np.ndarray, tuple[str, ...]]] = {}
    if has(STAGE.d_concat):
        x = heads(own[STAGE.d_concat], H)
        out[STAGE.d_head_outputs] = (x, r.rel(0) * A(x) + floor, (STAGE.d_concat,))
    if has(STAGE.d_head_outputs, STAGE.v_proj):
        dO, V = own[STAGE.d_head_outputs], heads(own[STAGE.v_proj], G, group)
        Vt = swap(V)
        out[STAGE.d_attn_weights] = (dO @ Vt, r.rel(E) * (A(dO) @ A(Vt)) + floor,
                                     (STAGE.d_head_outputs, STAGE.v_proj))
    s_abs = A(own[STAGE.scores]) if STAGE.scores in own else A(g[STAGE.scores])  # magnitudes only
    sink_abs = A(w["sink_logits"]).reshape(1, H, 1, 1) if cfg.sinks else None
    if has(STAGE.attn_weights, STAGE.d_attn_weights):
        P, dP = np.where(visible, own[STAGE.attn_weights], 0.0), np.where(visible, own[STAGE.d_attn_weights], 0.0)
        e_P = _softmax_recompute(A(P), s_abs, visible, r, sink_abs)
        dO = A(own[STAGE.d_head_outputs]) if STAGE.d_head_outputs in own else A(g[STAGE.d_head_outputs])
        V = A(heads(own[STAGE.v_proj] if STAGE.v_proj in own else g[STAGE.v_proj], G, group))
        O = A(own[STAGE.head_outputs]) if STAGE.head_outputs in own else A(P) @ V
        delta = (P * dP).sum(-1, keepdims=True)
        e_route_p = (e_P * A(dP)).sum(-1, keepdims=True) + r.rel(S) * ((A(P) + e_P) * A(dP)).sum(-1, keepdims=True)
        e_route_o = (dO * (r.rel(S) * ((A(P) + e_P) @ V))).sum(-1, keepdims=True) \
            + (A(P) * (r.rel(E) * (dO @ swap(V)))).sum(-1, keepdims=True) \
            + r.rel(E) * (dO * O).sum(-1, keepdims=True) + e_route_p
        e_delta = np.maximum(e_route_p, e_route_o)
        dS = P * (dP - delta)
        tol = e_P * (A(dP - delta) + e_delta) + A(P) * e_delta \
            + r.rel(0) * (A(P) + e_P) * (A(dP) + A(delta) + e_delta)
        out[STAGE.d_scores] = (np.where(visible, dS, 0.0), np.where(visible, tol + floor, 0.0),
                               (STAGE.attn_weights, STAGE.d_attn_weights))
        if STAGE.d_sink_logits in g and has(STAGE.lse):  # −Σ p_sink·δ, p_sink from the adapter's own lse
            out[STAGE.d_sink_logits] = bv.local_sink(golden, own[STAGE.lse], delta, e_delta, r)
    # the gradients of the score product's Q and K (q_rot, k_rot with RoPE: d_q_rot, d_k_rot) from the adapter's
    # d_scores (with softcap: bv.local_capped)
    q_name, k_name = bv.score_operands(cfg)
    d_q, d_k = (STAGE.d_q_rot, STAGE.d_k_rot) if cfg.rope is not None else (STAGE.d_q_proj, STAGE.d_k_proj)
    if has(STAGE.d_scores, k_name) and cfg.softcap is None:
        dS, K = own[STAGE.d_scores], heads(own[k_name], G, group)
        out[d_q] = (merge(scale * (dS @ K)), merge(scale * r.rel(S) * (A(dS) @ A(K))) + floor, (STAGE.d_scores, k_name))
    n_group = group * T
    if has(STAGE.d_scores, q_name) and cfg.softcap is None:
        dSg, Qg = grouped_t(own[STAGE.d_scores], G), grouped(heads(own[q_name], H), G)
        out[d_k] = (merge(scale * (dSg @ Qg)), merge(scale * r.rel(n_group) * (A(dSg) @ A(Qg))) + floor,
                    (STAGE.d_scores, q_name))
    out.update(bv.local_checks(golden, own, r, precision == "worst-case"))
    if has(STAGE.attn_weights, STAGE.d_head_outputs):
        P = np.where(visible, own[STAGE.attn_weights], 0.0)
        e_P = _softmax_recompute(A(P), s_abs, visible, r, sink_abs)
        Pg, ePg, dOg = grouped_t(P, G), grouped_t(e_P, G), grouped(own[STAGE.d_head_outputs], G)
        tol = ePg @ A(dOg) + r.rel(n_group) * ((A(Pg) + ePg) @ A(dOg))
        out[STAGE.d_v_proj] = (merge(Pg @ dOg), merge(tol) + floor, (STAGE.attn_weights, STAGE.d_head_outputs))

    def input_check(names: str) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]] | None:
        srcs = tuple(LINEAR[x].d_y for x in names)
        if not has(*srcs):
            return None
        n = sum(w[LINEAR[x].weight].shape[1] for x in names)
        val = sum(own[LINEAR[x].d_y] @ w[LINEAR[x].weight].T for x in names)
        mag = sum(A(own[LINEAR[x].d_y]) @ A(w[LINEAR[x].weight]).T for x in names)
        return val, r.rel(n) * mag + floor, srcs

    targets = INPUT_GRADIENTS[golden.spec.inputs]
    for stage, names in targets.items():
        check = input_check(names)
        if check is not None:
            out[stage] = check
    for n, m in LINEAR.items():  # weight gradients from the map's input and the adapter's gradient of its output
        src = m.x if m.d_y is None else m.d_y
        if not has(src):
            continue
        xs, dy = (own[src], dY) if m.d_y is None else (m.input_of(golden), own[src])
        rows = xs.shape[0] * xs.shape[1]
        xf, df = xs.reshape(rows, -1), dy.reshape(rows, -1)
        out[m.d_weight] = (xf.T @ df, r.rel(rows) * (A(xf).T @ A(df)) + floor, (src,))
        if cfg.bias and m.d_y is not None:
            out[m.d_bias] = (df.sum(0), r.rel(rows) * A(df).sum(0) + floor, (src,))
    return {s: v for s, v in out.items() if s in g}
