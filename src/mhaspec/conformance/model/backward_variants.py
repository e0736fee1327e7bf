"""The backward rules of the attention variants (docs/backward.md "The variants' gradients"), under both
precision contracts, one function per operation in the words of :mod:`.vocabulary`; :mod:`.backward`
calls them between its steps.  Reverse of :mod:`.variants`' order::

    d_scores ─Σ over the bias input's broadcast axes─► d_bias
    d_scores's δ, p_sink = exp(z − lse) ─ −Σ_{b,i} p_sink·δ ─► d_sink_logits
    d_scores ─⊙ sech²(s0/c) (softcap′)─► d_raw ─scale·d_raw K_rot, scale·Σ_group d_rawᵀ Q_rot─► d_q_rot, d_k_rot
    d_q_rot, d_k_rot ─RoPE turned back (−θ)─► d_q_proj, d_k_proj

* :func:`capped_grad` / :func:`capped_grad_worst` — softcap′: d_raw = d_scores ⊙ sech²(s0/c).  sech² moves
  with the raw logit s0 by at most h·|δs0| (h = the largest |d sech²(x/c)/dx| over the allowed move,
  :func:`softcap_slope`, the forward softcap rule's ``sech2_over_move`` read once more), plus its own
  rounding as autograd forms it (1 − t², t = tanh stored: :func:`sech2_rounding`), plus the product's;
* :func:`bias_grad` / :func:`bias_grad_worst` — d_bias: a sum of d_scores over the axes the bias broadcasts
  (its rounding + the propagated error); an entry that sums only masked entries is exactly 0
  (:func:`bias_seen`);
* :func:`sink_grad` / :func:`sink_grad_worst` — d_sink_logits[h] = −Σ_{b,i} p_sink·δ: p_sink's error from
  lse's bound (p_sink = exp(z − lse)) and its own rounding, δ's error (the larger of its two routes,
  :mod:`.backward`), the sum over the B·T rows;
* :func:`back_rotated` / :func:`back_rotated_worst` — d_q_proj, d_k_proj with RoPE: the forward RoPE rule
  (:func:`.variants.rope`, :func:`.variants.rope_worst`: |cos|, |sin| ≤ 1, the angle's and cos/sin's error)
  on the gradient; a turn by −θ has the same magnitudes as one by +θ.

d_q_rot and d_k_rot are today's d_q_proj and d_k_proj bounds with Q_rot, K_rot and d_raw (:mod:`.backward`
picks the operands: :func:`score_operands`).  A window changes only ``golden.visible``: no rule of its own.
Shapes (axis legend B, T, S, H, G = H_kv, D = D_k): scores-like (B, H, T, S), rows (B, H, T, 1), the bias
input's (B|1, H|1, T, S), d_sink_logits (H,).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...fixtures import GoldenCase
from ...spec import STAGE, variant_ops
from .variants import (FUNCTION_ULPS, TANH_ULPS, local_rope, raw_score_errors, raw_scores_worst, rope, rope_worst,
                       sech2_over_move, sink_share)
from .vocabulary import LAMBDA, Error, Rounding, heads, merge, stored, swap


# --- what the score product reads -------------------------------------------------------------------


def score_operands(config: Any) -> tuple[str, str]:
    """The stages the score product Q Kᵀ reads: (q_rot, k_rot) with RoPE, else (q_proj, k_proj)."""
    if config.rope is not None:
        return STAGE.q_rot, STAGE.k_rot
    return STAGE.q_proj, STAGE.k_proj


def raw_logits(golden: GoldenCase) -> np.ndarray:
    """(B, H, T, S) s0 = scale·Q_rot K_rotᵀ of the golden, in float64 (the logit softcap takes)."""
    cfg, g = golden.spec.config, golden.stages
    q_name, k_name = score_operands(cfg)
    Q, K = heads(g[q_name], cfg.H), heads(g[k_name], cfg.H_kv, cfg.group_size)
    return float(cfg.scale) * (Q @ swap(K))  # type: ignore[arg-type]


# --- softcap′ -----------------------------------------------------------------------------------------

def softcap_slope(s0: np.ndarray, tau: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sech²(s0/c), g, h) with g = the largest sech²(x/c) over |x − s0| ≤ τ (:func:`.variants.sech2_over_move`)
    and h = the largest |d sech²(x/c)/dx| = (2/c)·sech²·|tanh| there: sech² falls and |tanh| rises with |x|,
    so h ≤ (2/c)·g·tanh((|s0| + τ)/c); by the mean value theorem |δsech²| ≤ h·|δs0| (second order included)."""
    a = np.abs(s0) / cap
    sech2 = 1.0 / np.cosh(np.minimum(a, 350.0)) ** 2
    g = sech2_over_move(s0, tau, cap)
    return sech2, g, (2.0 / cap) * g * np.tanh(a + tau / cap)


def sech2_rounding(s0: np.ndarray, sech2: np.ndarray, h: np.ndarray,
                   r: Rounding) -> tuple[list[np.ndarray], np.ndarray]:
    """The roundings of a correct sech²(s0/c) as autograd forms it, 1 − t² with t = tanh(s0/c) stored:
    the independent ones' sizes — s0/c stored (h·u·|s0|), t stored (2t²·u), t² and 1 − t² in the
    accumulator (u_acc·t², u_acc·sech²), sech² stored (u·sech²) — and tanh's own, systematic
    (2t²·TANH_ULPS·u_acc).  Absolute, not relative: 1 − t² cancels where |s0| ≫ c."""
    t2 = 1.0 - sech2
    return [h * r.u * np.abs(s0), 2 * r.u * t2, r.acc * t2, r.acc * sech2, r.u * sech2], 2 * TANH_ULPS * r.acc * t2


def capped_grad(dS: np.ndarray, e_dS: Error, s0: np.ndarray, e_s0: Error, cap: float,
                r: Rounding) -> tuple[np.ndarray, Error]:
    """(d_raw = dS ⊙ sech²(s0/c), its error) under the standard contract, dS = d_scores carrying ``e_dS``,
    s0 carrying ``e_s0`` (τ = LAMBDA·T_s0): sech² off by h·δs0 (noise h²·var_s0, worst h·acc_s0) and
    :func:`sech2_rounding`; the product g²·T²_dS + dS²·var_sech², worst |dS|·acc_sech + g·lin_dS, and three
    storages of the result (dS·c, ·(1 − t²), /c: autograd's steps).  -> (B, H, T, S)."""
    sech2, g, h = softcap_slope(s0, LAMBDA * np.sqrt(e_s0.total_var), cap)
    noise, systematic = sech2_rounding(s0, sech2, h, r)
    var_s = h * h * e_s0.var + sum(x * x for x in noise)
    d_raw = dS * sech2
    var = g * g * e_dS.total_var + dS * dS * var_s + stored(r.u, d_raw, d_raw, d_raw)
    return d_raw, Error(var, np.abs(dS) * (h * e_s0.acc + systematic), g * e_dS.lin)


def capped_grad_worst(dS: np.ndarray, e_dS: np.ndarray, s0: np.ndarray, e_s0: np.ndarray, cap: float,
                      r: Rounding) -> tuple[np.ndarray, np.ndarray]:
    """(|d_raw|, its error) under the worst-case contract (|dS| off by ``e_dS``, s0 by ``e_s0``): sech² off by
    e_sech = min(h·e_s0, g) + :func:`sech2_rounding` at full size, the product
    (|dS| + e_dS)(sech² + e_sech) − |dS|·sech², and its three storages ρ(0) each."""
    sech2, g, h = softcap_slope(s0, e_s0, cap)
    noise, systematic = sech2_rounding(s0, sech2, h, r)
    e_sech = np.minimum(h * e_s0, g) + sum(noise) + systematic
    d_raw = np.abs(dS) * sech2
    hi = (np.abs(dS) + e_dS) * (sech2 + e_sech)
    return d_raw, (hi - d_raw) + 3 * r.rel(0) * hi


def raw_error(golden: GoldenCase, q: Error, k: Error, r: Rounding) -> tuple[np.ndarray, Error]:
    """(s0 (B, H, T, S), its error) under the standard contract from the score operands' errors (``q``
    (B, T, H·D), ``k`` (B, S, G·D): :func:`score_operands`' forward bounds): :func:`.variants.raw_score_errors`."""
    g = golden.stages
    q_name, k_name = score_operands(golden.spec.config)
    shape = golden.visible.shape
    s0, e = raw_score_errors(golden, g[q_name], q, g[k_name], k, r)
    return s0.reshape(shape), Error(np.reshape(e.var, shape), np.reshape(e.acc, shape))


def raw_error_worst(golden: GoldenCase, e_q: np.ndarray, e_k: np.ndarray, r: Rounding) -> tuple[np.ndarray, np.ndarray]:
    """(s0, its worst-case error) (B, H, T, S): :func:`.variants.raw_scores_worst`."""
    g = golden.stages
    q_name, k_name = score_operands(golden.spec.config)
    e = raw_scores_worst(golden, g[q_name], e_q, g[k_name], e_k, r.u, r.k)
    return raw_logits(golden), e.reshape(golden.visible.shape)


# --- d_bias -------------------------------------------------------------------------------------------

def bias_axes(golden: GoldenCase) -> tuple[int, ...]:
    """The axes of (B, H, T, S) the bias input broadcasts (size 1 where the case's is not): d_bias sums them."""
    shape = golden.inputs["bias"].shape
    return tuple(i for i in (0, 1) if shape[i] == 1 and golden.visible.shape[i] > 1)


def summed(x: Any, axes: tuple[int, ...]) -> Any:
    """Σ of ``x`` (B, H, T, S) over ``axes``, kept as size-1 axes (the bias input's shape)."""
    return np.sum(x, axis=axes, keepdims=True) if axes else x


def bias_seen(golden: GoldenCase) -> np.ndarray:
    """(the bias input's shape) whether an entry of d_bias sums any visible entry of d_scores: where not,
    d_bias is exactly 0 (tolerance 0)."""
    return summed(golden.visible, bias_axes(golden)) > 0


def bias_grad(golden: GoldenCase, dS: np.ndarray, e_dS: Error, r: Rounding) -> Error:
    """d_bias = Σ d_scores over the broadcast axes (n terms), standard contract: var Σ T²_dS (each term's
    accumulation one more independent term) + its storage, lin Σ lin_dS, acc γ_acc(n + k)·Σ|dS|; no axis
    summed: d_scores' own error."""
    axes = bias_axes(golden)
    if not axes:
        return e_dS
    n = int(np.prod([dS.shape[i] for i in axes]))
    lin = summed(np.broadcast_to(e_dS.lin, dS.shape), axes)
    return Error(summed(np.broadcast_to(e_dS.total_var, dS.shape), axes) + stored(r.u, golden.stages[STAGE.d_bias]),
                 r.gamma(n) * summed(np.abs(dS), axes), lin)


def bias_grad_worst(golden: GoldenCase, dS: np.ndarray, e_dS: np.ndarray, r: Rounding) -> np.ndarray:
    """d_bias's worst-case error: Σ e_dS + ρ(n)·Σ(|dS| + e_dS) over the broadcast axes (d_scores' own
    error where none is summed)."""
    axes = bias_axes(golden)
    if not axes:
        return e_dS
    n = int(np.prod([dS.shape[i] for i in axes]))
    return summed(e_dS, axes) + r.rel(n) * summed(np.abs(dS) + e_dS, axes)


# --- d_sink_logits ------------------------------------------------------------------------------------

def sink_rows(golden: GoldenCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p_sink, z, lse) of every row (B, H, T, 1): the sink's share exp(z − lse) (0 where no key is visible:
    :func:`.variants.sink_share`), the sink logit, lse (0 where −inf)."""
    g, H = golden.stages, golden.spec.config.H
    z = np.asarray(golden.weights["sink_logits"], dtype=np.float64).reshape(1, H, 1, 1)
    p = sink_share(g[STAGE.scores], golden.visible, z)
    lse_ = g[STAGE.lse][..., None]
    return p, z, np.where(np.isfinite(lse_), lse_, 0.0)


def sink_share_error(p: np.ndarray, z: np.ndarray, lse_: np.ndarray, e_lse: Error, r: Rounding) -> Error:
    """p_sink = exp(z − lse) off by p·δlse (lse's bound, linearised; its carried worst part exactly,
    p·expm1) and its own rounding: exp of the rounded z − lse (u_acc·(FUNCTION_ULPS + |z| + |lse|),
    systematic) and its storage (u).  The softmax's route (the sink as one more key) is within the same:
    its first order is lse's, its rounding a softmax's."""
    return Error(p * p * (e_lse.var + r.u**2), p * r.acc * (FUNCTION_ULPS + np.abs(z) + np.abs(lse_)),
                 p * np.expm1(e_lse.lin))


def sink_grad(golden: GoldenCase, delta: np.ndarray, e_delta: Error, e_lse: Error, r: Rounding) -> Error:
    """d_sink_logits[h] = −Σ_{b,i} p_sink·δ (B·T terms; δ (B, H, T, 1) carrying ``e_delta``, lse (B, H, T, 1)
    carrying ``e_lse``), standard contract: var Σ(δ²·T²_p + p²·T²_δ) + its storage, lin Σ(|δ|·lin_p +
    p·lin_δ), acc γ_acc(B·T + k)·Σ|p·δ|.  -> (H,)."""
    p, z, lse_ = sink_rows(golden)
    e_p = sink_share_error(p, z, lse_, e_lse, r)
    rows = (0, 2, 3)
    B, _, T, _ = golden.visible.shape
    var = np.sum(delta**2 * e_p.total_var + p * p * e_delta.total_var, axis=rows)
    lin = np.sum(np.abs(delta) * e_p.lin + p * e_delta.lin, axis=rows)
    acc = r.gamma(B * T) * np.sum(np.abs(p * delta), axis=rows)
    return Error(var + stored(r.u, golden.stages[STAGE.d_sink_logits]), acc, lin)


def sink_grad_worst(golden: GoldenCase, delta: np.ndarray, e_delta: np.ndarray, e_lse: np.ndarray,
                    r: Rounding) -> np.ndarray:
    """d_sink_logits' worst-case error: Σ(e_p·(|δ| + e_δ) + p·e_δ) + ρ(B·T)·Σ(p + e_p)(|δ| + e_δ), e_p =
    :func:`sink_share_error` at full size.  -> (H,)."""
    p, z, lse_ = sink_rows(golden)
    e = sink_share_error(p, z, lse_, Error(0.0, lin=e_lse), r)
    e_p = e.acc + e.lin + p * r.u
    d = np.abs(delta)
    rows = (0, 2, 3)
    B, _, T, _ = golden.visible.shape
    return (np.sum(e_p * (d + e_delta) + p * e_delta, axis=rows)
            + r.rel(B * T) * np.sum((p + e_p) * (d + e_delta), axis=rows))


# --- RoPE turned back ---------------------------------------------------------------------------------

def _rope_rows(golden: GoldenCase, which: str) -> tuple[int, np.ndarray]:
    """(heads, positions) of the query (``"q"``) or key (``"k"``) side."""
    cfg = golden.spec.config
    _, _, T, S = golden.visible.shape
    q_pos, k_pos = variant_ops.rope_positions(cfg, T, S, golden.row_offset)
    return (cfg.H, q_pos) if which == "q" else (cfg.H_kv, k_pos)


def back_rotated(golden: GoldenCase, which: str, d_rot: np.ndarray, e: Error, d_proj: np.ndarray,
                 r: Rounding) -> Error:
    """d_q_proj (``which`` "q") or d_k_proj ("k") = d_rot turned back by the same angle, standard contract:
    :func:`.variants.rope` of d_rot (sign-blind: the same bound for −θ), its result ``d_proj`` stored; the
    carried worst part turned as |cos|·lin_a + |sin|·lin_b (:func:`.variants.rope_worst` with no rounding)."""
    n_heads, pos = _rope_rows(golden, which)
    cfg = golden.spec.config
    _, out = rope(d_rot, Error(e.var, e.acc), n_heads, pos, cfg, r, d_proj)
    if not np.ndim(e.lin):
        return Error(out.var, out.acc, e.lin)
    zero = np.zeros_like(d_rot)
    return Error(out.var, out.acc, rope_worst(zero, np.broadcast_to(e.lin, d_rot.shape), n_heads, pos, cfg, 0.0, zero))


def back_rotated_worst(golden: GoldenCase, which: str, d_rot: np.ndarray, e: np.ndarray, d_proj: np.ndarray,
                       r: Rounding) -> np.ndarray:
    """The worst-case contract's error of d_q_proj / d_k_proj: :func:`.variants.rope_worst` of d_rot."""
    n_heads, pos = _rope_rows(golden, which)
    return rope_worst(d_rot, e, n_heads, pos, golden.spec.config, r.u, d_proj)


# --- the local checks -----------------------------------------------------------------------------------

def local_checks(golden: GoldenCase, own: dict[str, np.ndarray], r: Rounding,
                 worst_case: bool) -> dict[str, tuple[np.ndarray, np.ndarray, tuple[str, ...]]]:
    """The variants' backward local checks (:mod:`.backward_local`'s form: float64 recomputation, tolerance,
    sources), each from the adapter's own stages with only its own rounding: d_bias = Σ of its d_scores over
    the broadcast axes (ρ(n)·Σ|dS|); with RoPE, d_q_proj and d_k_proj = its d_q_rot, d_k_rot turned back
    (:func:`.variants.local_rope` at the negated positions: a turn by −θ, the input's storage, the angle's
    and cos/sin's error, the products'); with softcap, the gradients of the score product's Q and K from its
    d_scores and Q, K (:func:`local_capped`).  (Without softcap: :mod:`.backward_local`'s d_q_proj rule.)"""
    out: dict[str, tuple[np.ndarray, np.ndarray, tuple[str, ...]]] = {}
    if STAGE.d_bias in golden.stages and STAGE.d_scores in own:
        dS, axes = own[STAGE.d_scores], bias_axes(golden)
        n = int(np.prod([dS.shape[i] for i in axes]))
        out[STAGE.d_bias] = (summed(dS, axes), r.rel(n) * summed(np.abs(dS), axes) + r.floor, (STAGE.d_scores,))
    cfg = golden.spec.config
    q_name, k_name = score_operands(cfg)
    if cfg.softcap is not None and all(x in own for x in (STAGE.d_scores, q_name, k_name)):
        out.update(local_capped(golden, own[STAGE.d_scores], own[q_name], own[k_name], r))
    if cfg.rope is not None:
        for which, rot, proj in (("q", STAGE.d_q_rot, STAGE.d_q_proj), ("k", STAGE.d_k_rot, STAGE.d_k_proj)):
            if rot in own:
                n_heads, pos = _rope_rows(golden, which)
                ref, b = local_rope(own[rot], n_heads, -pos, golden.spec.config, r, worst_case)
                out[proj] = (ref, b.tolerance(LAMBDA), (rot,))
    return out


def local_capped(golden: GoldenCase, dS: np.ndarray, q: np.ndarray, k: np.ndarray,
                 r: Rounding) -> dict[str, tuple[np.ndarray, np.ndarray, tuple[str, ...]]]:
    """With softcap, d_q_rot and d_k_rot (d_q_proj and d_k_proj without RoPE) from the adapter's own d_scores
    dS and score operands q (B, T, H·D), k (B, S, G·D): d_raw = dS ⊙ sech²(s0/c) with s0 = scale·Q Kᵀ in
    float64, the adapter's own s0 off by its product's rounding ρ(D_k)·scale·|Q||K|ᵀ (:func:`capped_grad_worst`),
    then scale·d_raw K and scale·Σ_group d_rawᵀ Q with their rounding ρ(n)."""
    cfg = golden.spec.config
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    q_name, k_name = score_operands(cfg)
    d_q, d_k = (STAGE.d_q_rot, STAGE.d_k_rot) if cfg.rope is not None else (STAGE.d_q_proj, STAGE.d_k_proj)
    Q, K = heads(q, H), heads(k, G, group)
    s0 = scale * (Q @ swap(K))
    e_s0 = r.rel(cfg.D_k) * scale * (np.abs(Q) @ swap(np.abs(K)))
    sech2, _, _ = softcap_slope(s0, e_s0, float(cfg.softcap))  # type: ignore[arg-type]
    d_raw = dS * sech2
    mag, e_raw = capped_grad_worst(dS, 0.0 * dS, s0, e_s0, float(cfg.softcap), r)  # type: ignore[arg-type]
    B, _, T, _ = dS.shape
    n_group = group * T

    def grouped_sum(x: np.ndarray) -> np.ndarray:  # (B, H, S, D) summed over each group's query heads
        return x.reshape(B, G, group, *x.shape[2:]).sum(axis=2)

    hi_q = (mag + e_raw) @ np.abs(K)
    hi_k = grouped_sum(swap(mag + e_raw) @ np.abs(Q))
    tol_q = scale * ((hi_q - mag @ np.abs(K)) + r.rel(golden.spec.src_len) * hi_q) + r.floor
    tol_k = scale * ((hi_k - grouped_sum(swap(mag) @ np.abs(Q))) + r.rel(n_group) * hi_k) + r.floor
    return {d_q: (merge(scale * (d_raw @ K)), merge(tol_q), (STAGE.d_scores, q_name, k_name)),
            d_k: (merge(scale * grouped_sum(swap(d_raw) @ Q)), merge(tol_k), (STAGE.d_scores, q_name, k_name))}


def local_sink(golden: GoldenCase, lse_own: np.ndarray, delta: np.ndarray, e_delta: np.ndarray,
               r: Rounding) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """d_sink_logits from the adapter's own lse (B, H, T) and δ (B, H, T, 1) of its own P and d_attn_weights
    (off by ``e_delta``, :mod:`.backward_local`'s d_scores rule): −Σ_{b,i} exp(z − lse)·δ; p_sink off by its
    lse's storage (u·|lse|, relative) and :func:`sink_share_error`'s own rounding, the sum by ρ(B·T)."""
    H = golden.spec.config.H
    z = np.asarray(golden.weights["sink_logits"], dtype=np.float64).reshape(1, H, 1, 1)
    lse_ = lse_own[..., None]
    seen = np.isfinite(lse_)
    lse_ = np.where(seen, lse_, 0.0)
    p = np.where(seen, np.exp(np.minimum(z - lse_, 350.0)), 0.0)
    e = sink_share_error(p, z, lse_, Error(0.0, lin=r.u * np.abs(lse_)), r)
    e_p = e.acc + e.lin + p * r.u
    d = np.abs(delta)
    rows = (0, 2, 3)
    B, _, T, _ = golden.visible.shape
    tol = (np.sum(e_p * (d + e_delta) + p * e_delta, axis=rows)
           + r.rel(B * T) * np.sum((p + e_p) * (d + e_delta), axis=rows))
    return -np.sum(p * delta, axis=rows), tol + r.floor, (STAGE.lse, STAGE.attn_weights, STAGE.d_attn_weights)
