"""Element-wise tolerances of the backward stages: the forward's running error
bound, carried on through the backward pass (docs/backward.md derives it).

Each backward stage's bound = **propagated** (its inputs — forward stages and
earlier backward stages, computed in the same dtype — are already off by
their own bounds, taken at their full size) + **own rounding** ``ρ(n)·Σ|aᵢ·bᵢ|``
for a length-n sum of products, which holds for every summation order and
blocking, and for sums split over a GQA group or over self-attention's three
input gradients.  Under the two precision contracts of docs/tolerances.md:

* ``"standard"``: results stored in the dtype, sums in float32 or wider:
  ``ρ(n) = γ_acc(n + k) + 3u`` (the accumulation, the storage of both operands —
  an implementation may have used them unrounded — and of the result);
* ``"worst-case"``: accumulation in the dtype itself: ``ρ(n) = γ_u(n + k)``.

The forward bounds are an input (``forward``, under the same contract:
:func:`mhaspec.conformance.tolerance.golden_bounds` or ``stage_tolerances`` computes them);
the rounding facts (:class:`~.vocabulary.Rounding`, ρ(n) = ``Rounding.rel``), the storage
rounding and the softmax propagation are the forward model's (:mod:`.vocabulary`,
:mod:`.softmax`).  The local checks are in :mod:`.backward_local`.

Where a correct implementation may take one of two routes, the bound is the
larger of the two: the softmax-Jacobian row term δ = Σ_S P ⊙ dP may be computed
as written, or FlashAttention's way as Σ_E dO ⊙ O (equal in exact arithmetic).

Masked ``d_scores`` entries get no tolerance: they must be exactly 0.
Shapes as in :mod:`mhaspec.spec.backward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...fixtures import GoldenCase
from ...spec import INPUT_GRADIENTS, STAGE
from ...spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from . import backward_variants as bv, variants as variant_rules
from .softmax import rest_of_row, softmax_sigma2
from .forward import worst_case_allowed, worst_case_tolerances
from .vocabulary import (EXACT, LINEAR, Bound, Error, Rounding, grouped, grouped_t, heads, merge, product, rounding,
                         stored, swap)


def _product_bound(a: np.ndarray, e_a: np.ndarray, b: np.ndarray, e_b: np.ndarray,
                   n: int, r: Rounding) -> np.ndarray:
    """Bound of ``a @ b`` when |a|, |b| are off by e_a, e_b: propagated + ρ(n)·(|a|+e_a)(|b|+e_b)."""
    hi = (a + e_a) @ (b + e_b)
    return (hi - a @ b) + r.rel(n) * hi


def _sum_bound(d: np.ndarray, e_d: np.ndarray, r: Rounding) -> np.ndarray:
    """Bound of Σ over B and L of ``d`` (B, L, N) off by e_d: Σ e_d + ρ(B·L)·Σ(|d| + e_d)."""
    rows = d.shape[0] * d.shape[1]
    return e_d.sum(axis=(0, 1)) + r.rel(rows) * (d + e_d).sum(axis=(0, 1))


def backward_tolerances(golden: GoldenCase, dtype: str, forward: Mapping[str, np.ndarray],
                        table: ToleranceTable = DEFAULT_TOLERANCES, precision: str = "standard") -> dict[str, np.ndarray]:
    """The allowed absolute error of every element of every backward stage of ``golden`` in ``dtype``:
    every error at its full size (the ``"worst-case"`` contract's bound; under ``"standard"``, a
    far wider bound than :func:`backward_bounds`).

    ``forward`` are the forward stages' element-wise bounds under the same ``precision`` contract.
    """
    r = rounding(dtype, precision, table)
    fw = forward
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    visible = golden.visible
    S, D, E = golden.spec.src_len, cfg.D_k, cfg.D_v
    A = np.abs
    assert golden.d_output is not None
    dY = A(golden.d_output)  # exact in every dtype

    # 1. d_concat = d_output @ w_oᵀ: exact operands, only local rounding; d_head_outputs is a relabelling.
    e_dc = r.rel(cfg.d_out) * (dY @ A(w["w_o"]).T)
    e_dO = heads(e_dc, H)
    dO = A(g[STAGE.d_head_outputs])

    # 2. d_attn_weights = dO Vᵀ (V off by the forward's E_v).
    V, e_V = A(heads(g[STAGE.v_proj], G, group)), heads(fw[STAGE.v_proj], G, group)
    e_dP = _product_bound(dO, e_dO, swap(V), swap(e_V), E, r)

    # 3. d_scores = P ⊙ (dP − δ).  δ either as Σ_S P·dP or as Σ_E dO·O: the larger bound.
    P, e_P = g[STAGE.attn_weights], np.where(visible, fw[STAGE.attn_weights], 0.0)
    dP = A(g[STAGE.d_attn_weights])
    O, e_O = A(g[STAGE.head_outputs]), fw[STAGE.head_outputs]
    e_delta_p = (e_P * dP + (P + e_P) * e_dP).sum(-1, keepdims=True) \
        + r.rel(S) * ((P + e_P) * (dP + e_dP)).sum(-1, keepdims=True)
    e_delta_o = (e_dO * O + (dO + e_dO) * e_O).sum(-1, keepdims=True) \
        + r.rel(E) * ((dO + e_dO) * (O + e_O)).sum(-1, keepdims=True)
    e_delta = np.maximum(e_delta_p, e_delta_o)  # (B, H, T, 1)
    delta = A((P * g[STAGE.d_attn_weights]).sum(-1, keepdims=True))
    diff = A(g[STAGE.d_attn_weights] - (P * g[STAGE.d_attn_weights]).sum(-1, keepdims=True))
    e_diff = e_dP + e_delta
    # product P·(dP − δ), or P·dP − P·δ expanded: local rounding on the larger magnitudes
    e_dS = e_P * (diff + e_diff) + P * e_diff + r.rel(0) * (P + e_P) * (dP + e_dP + delta + e_delta)
    e_dS = np.where(visible, e_dS, 0.0)

    # 3a. the variants' gradients of the logits (docs/backward.md "The variants' gradients"): d_bias,
    #     d_sink_logits; softcap′ d_raw = dS ⊙ sech²(s0/c) (d_raw = dS without softcap).
    dS = A(g[STAGE.d_scores])
    variant = {}
    if STAGE.d_bias in g:
        variant[STAGE.d_bias] = bv.bias_grad_worst(golden, dS, e_dS, r)
    if STAGE.d_sink_logits in g:
        variant[STAGE.d_sink_logits] = bv.sink_grad_worst(golden, delta, e_delta, fw[STAGE.lse][..., None], r)
    q_name, k_name = bv.score_operands(cfg)  # Q_rot, K_rot with RoPE
    d_raw, e_draw = dS, e_dS
    if cfg.softcap is not None:
        s0, e_s0 = bv.raw_error_worst(golden, fw[q_name], fw[k_name], r)
        d_raw, e_draw = bv.capped_grad_worst(dS, e_dS, s0, e_s0, float(cfg.softcap), r)

    # 4. d_q_proj = scale·dS K;  d_k_proj = scale·Σ_group dSᵀ Q;  d_v_proj = Σ_group Pᵀ dO — with RoPE
    #    d_q_rot, d_k_rot, turned back into d_q_proj, d_k_proj.
    K, e_K = A(heads(g[k_name], G, group)), heads(fw[k_name], G, group)
    Q, e_Q = A(heads(g[q_name], H)), heads(fw[q_name], H)
    n_group = group * golden.spec.tgt_len
    e_dq = merge(scale * _product_bound(d_raw, e_draw, K, e_K, S, r))
    e_dk = merge(scale * _product_bound(grouped_t(d_raw, G), grouped_t(e_draw, G), grouped(Q, G), grouped(e_Q, G),
                                         n_group, r))
    if cfg.rope is not None:
        variant[STAGE.d_q_rot], variant[STAGE.d_k_rot] = e_dq, e_dk
        e_dq = bv.back_rotated_worst(golden, "q", g[STAGE.d_q_rot], e_dq, g[STAGE.d_q_proj], r)
        e_dk = bv.back_rotated_worst(golden, "k", g[STAGE.d_k_rot], e_dk, g[STAGE.d_k_proj], r)
    e_dv = merge(_product_bound(grouped_t(P, G), grouped_t(e_P, G), grouped(dO, G), grouped(e_dO, G),
                                 n_group, r))
    bounds = {
        STAGE.d_concat: e_dc, STAGE.d_head_outputs: e_dO, STAGE.d_attn_weights: e_dP, STAGE.d_scores: e_dS,
        STAGE.d_q_proj: e_dq, STAGE.d_k_proj: e_dk, STAGE.d_v_proj: e_dv, **variant,
    }

    # 5. input gradients: Σ_i d_y_i @ w_iᵀ (three terms for self-attention's one input tensor).
    d_y = {"q": A(g[STAGE.d_q_proj]), "k": A(g[STAGE.d_k_proj]), "v": A(g[STAGE.d_v_proj]), "o": dY}
    e_y = {"q": e_dq, "k": e_dk, "v": e_dv, "o": np.zeros_like(dY)}

    def input_bound(names: str) -> np.ndarray:
        n = sum(w[LINEAR[x].weight].shape[1] for x in names)
        prop = sum(e_y[x] @ A(w[LINEAR[x].weight]).T for x in names)
        hi = sum((d_y[x] + e_y[x]) @ A(w[LINEAR[x].weight]).T for x in names)
        return prop + r.rel(n) * hi

    for name, sums in INPUT_GRADIENTS[golden.spec.inputs].items():
        bounds[name] = input_bound(sums)

    # 6. weight gradients xᵀ d_y over B·L rows (concat, the input of W^O, is off by the forward's E_c),
    #    bias gradients Σ d_y.
    e_x = {"q": 0.0, "k": 0.0, "v": 0.0, "o": fw[STAGE.concat]}
    for n, m in LINEAR.items():
        x = A(m.input_of(golden))
        rows = x.shape[0] * x.shape[1]
        ex = np.broadcast_to(e_x[n], x.shape).reshape(rows, -1)
        xf = x.reshape(rows, -1)
        dyf, eyf = d_y[n].reshape(rows, -1), e_y[n].reshape(rows, -1)
        bounds[m.d_weight] = _product_bound(xf.T, ex.T, dyf, eyf, rows, r)
        if cfg.bias:
            bounds[m.d_bias] = _sum_bound(d_y[n], e_y[n], r)

    out = worst_case_allowed({name: b for name, b in bounds.items() if name in g}, r.floor)
    out[STAGE.d_scores] = np.where(visible, out[STAGE.d_scores], 0.0)  # masked: exactly 0
    if STAGE.d_bias in out:  # an entry that sums only masked (exact 0) d_scores: exactly 0
        out[STAGE.d_bias] = np.where(bv.bias_seen(golden), out[STAGE.d_bias], 0.0)
    return out


# -- the standard contract's bounds: the forward's model, carried through the backward pass ---------
#
# Each stage's error is an Error (var, acc, lin), its tolerance ``LAMBDA·sqrt(var) + lin + acc + floor``:
#   var — rounding noise (storage roundings of every earlier result, propagated linearised,
#         independent terms adding in quadrature, as in the forward model);
#   acc — the stage's own float32 (or wider) accumulation, worst-case; a later stage takes it
#         as one more independent term of its variance (the forward's rule);
#   lin — what is carried worst-case all the way: the forward softmax's second-order term and
#         the accumulation of P·V (the forward's ``worst`` of attn_weights, head_outputs, concat).


def _forward_err(bound: Bound, carried: bool) -> Error:
    """A forward stage's error as a backward input: its noise, and its worst-case part either as
    accumulation (→ variance later, the projections) or carried worst-case (softmax and after)."""
    if carried:
        return Error(bound.sigma**2, lin=bound.worst)
    return Error(bound.sigma**2, bound.worst)


def backward_bounds(golden: GoldenCase, dtype: str, forward: Mapping[str, Bound] | None,
                    table: ToleranceTable = DEFAULT_TOLERANCES, precision: str = "standard") -> dict[str, Bound]:
    """The allowed error of every backward stage of ``golden`` in ``dtype`` as :class:`Bound`\\ s.

    ``"standard"``: the forward's model (rounding noise root-sum-square, accumulation worst-case;
    docs/tolerances.md, docs/backward.md) carried through the backward pass, from the forward
    stages' bounds (``forward``: :func:`~mhaspec.conformance.tolerance.golden_bounds`).
    ``"worst-case"``: :func:`backward_tolerances` as the worst-case part, no noise part (from the
    forward's worst-case tolerances, computed here: ``forward`` is not read).
    """
    r = rounding(dtype, precision, table)
    if precision == "worst-case":
        fw = (variant_rules.worst_case_tolerances if variant_rules.variant_case(golden)  # the variants' rules
              else worst_case_tolerances)(golden, dtype, table)
        return {k: Bound.worst_case(v) for k, v in backward_tolerances(golden, dtype, fw, table=table,
                                                                       precision=precision).items()}
    assert forward is not None, "the standard contract's backward bounds start from the forward's"
    fb = forward
    u, gam = r.u, r.gamma

    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    vis = golden.visible
    S, T, E = golden.spec.src_len, golden.spec.tgt_len, cfg.D_v
    A = np.abs
    assert golden.d_output is not None
    dY = golden.d_output  # exact in every dtype
    err: dict[str, Error] = {}

    with np.errstate(over="ignore", invalid="ignore"):
        # 1. d_concat = d_output @ w_oᵀ (exact operands); d_head_outputs relabels it.
        err[STAGE.d_concat] = product(dY, EXACT, w["w_o"].T, EXACT, gam(cfg.d_out), u, (g[STAGE.d_concat],))
        e = err[STAGE.d_concat]
        err[STAGE.d_head_outputs] = e.map(lambda x: heads(x, H))
        dO, e_dO = g[STAGE.d_head_outputs], err[STAGE.d_head_outputs]

        # 2. d_attn_weights = dO Vᵀ (V off by the forward's bound).
        V = heads(g[STAGE.v_proj], G, group)
        e_Vt = _forward_err(fb[STAGE.v_proj], carried=False).map(lambda x: swap(heads(x, G, group)))
        dP = g[STAGE.d_attn_weights]
        err[STAGE.d_attn_weights] = product(dO, e_dO, swap(V), e_Vt, gam(E), u, (dP,))
        e_dP = err[STAGE.d_attn_weights]

        # 3. d_scores = P ⊙ (dP − δ), linearised with the exact coefficients: ∂dS_j/∂P_k =
        #    δ_jk (dP_j − δ) − P_j dP_k, ∂dS_j/∂dP_k = P_j (δ_jk − P_k).  δ either as Σ_S P·dP or
        #    FlashAttention's Σ_E dO·O: the larger of the two routes' bounds.
        P = np.where(vis, g[STAGE.attn_weights], 0.0)
        e_P = _forward_err(fb[STAGE.attn_weights], carried=True)
        vP, lP = np.where(vis, e_P.var, 0.0), np.where(vis, e_P.lin, 0.0)
        vdP = np.where(vis, e_dP.total_var, 0.0)
        ldP = np.where(vis, e_dP.lin, 0.0) if np.ndim(e_dP.lin) else 0.0 * P
        dPv = np.where(vis, dP, 0.0)
        delta = np.sum(P * dPv, axis=-1, keepdims=True)
        diff = dPv - delta
        a_j = diff - P * dPv
        # route P: δ = Σ_S P dP, its accumulation γ(S)·Σ|P dP|; P's noise enters through a_j and the row's other
        # keys, dP's as score noise enters the softmax (its Jacobian P_j (δ_jk − P_k): softmax_sigma2)
        var_p = a_j**2 * vP + P**2 * rest_of_row(dPv**2 * vP) + softmax_sigma2(P, vdP)
        lin_p = (A(a_j) * lP + P * np.sum(A(dPv) * lP, -1, keepdims=True)
                 + P * ((1 - P) * ldP + np.sum(P * ldP, -1, keepdims=True)))
        acc_p = P * gam(S) * np.sum(A(P * dPv), -1, keepdims=True)
        # route O: δ = Σ_E dO O (O = head_outputs, off by the forward's bound)
        O = g[STAGE.head_outputs]
        e_O = _forward_err(fb[STAGE.head_outputs], carried=True)
        var_d = np.sum(O**2 * e_dO.total_var + dO**2 * e_O.var, -1, keepdims=True)
        lin_d = np.sum(A(dO) * e_O.lin, -1, keepdims=True)
        var_o = diff**2 * vP + P**2 * vdP + P**2 * var_d
        lin_o = A(diff) * lP + P * ldP + P * lin_d
        acc_o = P * gam(E) * np.sum(A(dO * O), -1, keepdims=True)
        dS = g[STAGE.d_scores]
        # the difference and the product (or P·dP − P·δ expanded) are each stored once more
        var_s = np.maximum(var_p, var_o) + u**2 * P**2 * (diff**2 + dPv**2 + delta**2) + stored(u, dS)
        err[STAGE.d_scores] = Error(np.where(vis, var_s, 0.0), np.where(vis, np.maximum(acc_p, acc_o), 0.0),
                                    np.where(vis, np.maximum(lin_p, lin_o), 0.0))
        e_dS = err[STAGE.d_scores]

        # 3a. the variants' gradients of the logits (docs/backward.md "The variants' gradients"): d_bias,
        #     d_sink_logits (δ's own error: the larger of its two routes'); softcap′ d_raw = dS ⊙ sech²(s0/c).
        if STAGE.d_bias in g:
            err[STAGE.d_bias] = bv.bias_grad(golden, dS, e_dS, r)
        if STAGE.d_sink_logits in g:
            e_delta = Error(np.maximum(np.sum(dPv**2 * vP + P**2 * vdP, -1, keepdims=True), var_d),
                            np.maximum(gam(S) * np.sum(A(P * dPv), -1, keepdims=True),
                                       gam(E) * np.sum(A(dO * O), -1, keepdims=True)),
                            np.maximum(np.sum(A(dPv) * lP + P * ldP, -1, keepdims=True), lin_d))
            e_lse = _forward_err(fb[STAGE.lse], carried=True).map(lambda x: x[..., None])  # (B, H, T, 1)
            err[STAGE.d_sink_logits] = bv.sink_grad(golden, delta, e_delta, e_lse, r)
        q_name, k_name = bv.score_operands(cfg)  # Q_rot, K_rot with RoPE
        e_q, e_k = (_forward_err(fb[x], carried=False) for x in (q_name, k_name))
        d_raw, e_draw = dS, e_dS
        if cfg.softcap is not None:
            s0, e_s0 = bv.raw_error(golden, e_q, e_k, r)
            d_raw, e_draw = bv.capped_grad(dS, e_dS, s0, e_s0, float(cfg.softcap), r)

        # 4. d_q_proj = scale·dS K;  d_k_proj = scale·Σ_group dSᵀ Q;  d_v_proj = Σ_group Pᵀ dO — with RoPE
        #    d_q_rot, d_k_rot, turned back into d_q_proj, d_k_proj.
        K = heads(g[k_name], G, group)
        e_K = e_k.map(lambda x: heads(x, G, group))
        Q = heads(g[q_name], H)
        e_Q = e_q.map(lambda x: heads(x, H))

        def merged_stored(x: Error, y: np.ndarray) -> Error:  # merged to the canonical shape, stored in the dtype
            x = x.map(merge)
            return Error(x.var + stored(u, y), x.acc, x.lin)

        def stacked_t(x: np.ndarray) -> np.ndarray:
            return grouped_t(x, G)

        def stacked(x: np.ndarray) -> np.ndarray:
            return grouped(x, G)

        n_group = group * T
        d_q, d_k = (STAGE.d_q_rot, STAGE.d_k_rot) if cfg.rope is not None else (STAGE.d_q_proj, STAGE.d_k_proj)
        e = product(d_raw, e_draw, K, e_K, gam(S), u)
        err[d_q] = merged_stored(e.scaled(scale), g[d_q])
        e = product(stacked_t(d_raw), e_draw.map(stacked_t), stacked(Q), e_Q.map(stacked), gam(n_group), u)
        err[d_k] = merged_stored(e.scaled(scale), g[d_k])
        if cfg.rope is not None:
            err[STAGE.d_q_proj] = bv.back_rotated(golden, "q", g[d_q], err[d_q], g[STAGE.d_q_proj], r)
            err[STAGE.d_k_proj] = bv.back_rotated(golden, "k", g[d_k], err[d_k], g[STAGE.d_k_proj], r)
        e_Pg = Error(stacked_t(vP), lin=stacked_t(lP))
        e = product(stacked_t(P), e_Pg, stacked(dO), e_dO.map(stacked), gam(n_group), u)
        err[STAGE.d_v_proj] = merged_stored(e, g[STAGE.d_v_proj])

        # 5. input gradients: Σ_i d_y_i @ w_iᵀ (three terms for self-attention's one input tensor).
        d_y = {x: g[m.d_y] for x, m in LINEAR.items() if m.d_y is not None}
        for name, sums in INPUT_GRADIENTS[golden.spec.inputs].items():
            if name not in g:
                continue
            n = sum(w[LINEAR[x].weight].shape[1] for x in sums)
            var: Any = stored(u, g[name])
            lin: Any = 0.0
            mag: Any = 0.0
            for x in sums:
                wt = w[LINEAR[x].weight].T
                ex = err[LINEAR[x].d_y]  # type: ignore[index]
                var = var + ex.total_var @ (wt * wt)
                if np.ndim(ex.lin):
                    lin = lin + ex.lin @ A(wt)
                mag = mag + A(d_y[x]) @ A(wt)
            err[name] = Error(var, gam(n) * mag, lin)

        # 6. weight gradients xᵀ d_y over B·L rows (concat, the input of W^O, carries the forward's
        #    bound), bias gradients Σ d_y.
        ys = {**d_y, "o": dY}
        e_ys = {x: err[m.d_y] for x, m in LINEAR.items() if m.d_y is not None} | {"o": EXACT}
        e_c = _forward_err(fb[STAGE.concat], carried=True)
        for n, m in LINEAR.items():
            xs = m.input_of(golden)
            rows = xs.shape[0] * xs.shape[1]
            xf, yf = xs.reshape(rows, -1), ys[n].reshape(rows, -1)
            ex = EXACT if n != "o" else e_c.map(lambda v: v.reshape(rows, -1).T)
            ey = e_ys[n]
            eyf = ey.map(lambda v: v.reshape(rows, -1))
            err[m.d_weight] = product(xf.T, ex, yf, eyf, gam(rows), u, (g[m.d_weight],))
            if cfg.bias and m.d_bias in g:
                tv = np.reshape(np.broadcast_to(ey.total_var, ys[n].shape), (rows, -1)).sum(0)
                ln = np.reshape(np.broadcast_to(ey.lin, ys[n].shape), (rows, -1)).sum(0)
                err[m.d_bias] = Error(tv + stored(u, g[m.d_bias]), gam(rows) * A(yf).sum(0), ln)

    out = {name: e.bound(r.floor, g[name].shape) for name, e in err.items() if name in g}
    b = out[STAGE.d_scores]
    out[STAGE.d_scores] = Bound(np.where(vis, b.sigma, 0.0), np.where(vis, b.worst, 0.0))
    if STAGE.d_bias in out:  # an entry that sums only masked (exact 0) d_scores: exactly 0
        b, seen = out[STAGE.d_bias], bv.bias_seen(golden)
        out[STAGE.d_bias] = Bound(np.where(seen, b.sigma, 0.0), np.where(seen, b.worst, 0.0))
    return out
