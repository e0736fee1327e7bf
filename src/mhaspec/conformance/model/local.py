"""The local checks' rules: each stage recomputed in float64 from the adapter's *own* previous
stage(s), with a bound of that stage's own rounding only (docs/tolerances.md "Two checks per
exposed stage: golden and local").

The bound holds the stage's own rounding plus the storage rounding of its inputs as returned
(the adapter may have used them unrounded); nothing propagated from earlier stages, so it is
as tight in bfloat16 as in float64.  Under ``precision="worst-case"`` every rounding is counted
at its full size (:func:`local_bound`).

* :func:`scores`       s = scale · q Kᵀ              from q_proj, k_proj
* :func:`weights`      p = softmax_visible(s)        from scores
* :func:`head_outputs` o = P V (+ :func:`weights_route`) from attn_weights, v_proj
* :func:`concat`       the heads merged              from head_outputs
* :func:`output`       y = concat W_o + b_o          from concat

The (B·H, T, ·) rules run on one chunk of heads × query rows at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...spec import REGISTRY, STAGES
from .softmax import (score_moves, second_order, softmax_rounding, softmax_visible, softmax_worst,
                      visible_row_max, weights_sigma)
from .vocabulary import (EXACT, LAMBDA, Acc, Bound, Error, Pair, Rounding, inf_for_nan, merge, product, stored, swap,
                         upper32)

#: stage -> the stages it is recomputed from in a local check (spec/stages.py)
LOCAL_INPUTS: dict[str, tuple[str, ...]] = {n: REGISTRY[n].local_inputs for n in STAGES if REGISTRY[n].local_inputs}


def local_bound(e: Error, r: Rounding, worst_case: bool) -> Bound:
    """A local check's :class:`Bound` from its own :class:`~.vocabulary.Error` (``var``, ``acc``).

    Standard: sigma = sqrt(var), worst = acc + floor, NaN made +inf in ``worst`` only: where the
    adapter's own values make ``var`` NaN, sigma stays NaN and the element takes no part in the
    mean-square test.  Worst-case: every rounding at its full size, no averaging (sigma 0,
    worst = LAMBDA·sqrt(var) + acc + floor)."""
    if worst_case:
        return Bound(np.zeros_like(e.acc), inf_for_nan(np.sqrt(e.var) * LAMBDA + e.acc) + r.floor)
    return Bound(np.sqrt(np.maximum(e.var, 0.0)), inf_for_nan(e.acc + r.floor))


def scores(q: np.ndarray, K: np.ndarray, K2: Pair, aK: Pair, scale: float, a_d: Acc, r: Rounding,
           worst_case: bool) -> tuple[np.ndarray, Bound]:
    """s = scale · q Kᵀ from the adapter's q and K (``K2`` = K²ᵀ, ``aK`` = |K|ᵀ), both as returned:

    var = 2u²·scale²·q² @ K²ᵀ + 2u²·s² + U64²·s² + (σ_d·m)², worst = γ_d·m, m = scale·|q|@|K|ᵀ
    ((γ_d, σ_d) = ``a_d``, :meth:`~.vocabulary.Rounding.accumulation`)."""
    u2 = r.u**2
    x = scale * (q @ swap(K))
    var = (2 * scale**2 * u2) * upper32(q * q, K2) + stored(r.u, x, x)
    return x, local_bound(Error(var, scale * upper32(np.abs(q), aK)).accumulated(a_d), r, worst_case)


def weights(s: np.ndarray, vis: np.ndarray, a_s: Acc, r: Rounding,
            worst_case: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """p = softmax of the adapter's own visible scores, with (sigma, worst) of its own rounding and
    of the scores' storage rounding (the scores as returned may be rounded copies), 0 where masked:

    T_s² = u²·s² + U64²·s², sigma = p_j·sqrt((1 − p_j)²T²_sj + Σ_{k≠j} p_k²T²_sk + u² + U64² + σ_S²),
    worst = p_j·(γ_S + u_acc·(|s_j| + max|s|)) + second order (τ = LAMBDA·T_s) + floor
    ((γ_S, σ_S) = ``a_s``); worst-case: the exact bound :func:`~.softmax.softmax_worst` instead of the
    second order."""
    x = softmax_visible(s, vis)
    s2 = np.where(vis, stored(r.u, s), 0.0)
    abs_s = np.abs(s)
    worst = x * softmax_rounding(abs_s, visible_row_max(abs_s, vis), a_s.worst, r.acc)
    tau = score_moves(s2, vis)
    if worst_case:
        b = local_bound(Error(stored(r.u, x), worst + softmax_worst(x, tau)), r, worst_case)
    else:  # relative form: p² underflows for tiny weights
        b = Bound(weights_sigma(x, s2, r.u, a_s.sigma), inf_for_nan(worst + second_order(x, tau)) + r.floor)
    return x, np.where(vis, b.sigma, 0.0), np.where(vis, b.worst, 0.0)


def head_outputs(pc: np.ndarray, V: np.ndarray, V2: Pair, aV: Pair, a_s: Acc, r: Rounding,
                 worst_case: bool) -> tuple[np.ndarray, Bound]:
    """o = P V from the adapter's own weights and values (``V2`` = V², ``aV`` = |V|):

    var = 2u²·P² @ V² + 2u²·o² + U64²·o² + (σ_S·m)², worst = γ_S·m, m = |P|@|V| ((γ_S, σ_S) = ``a_s``;
    the weights' route allowance is added afterwards: :func:`weights_route`)."""
    x = pc @ V
    var = (2 * r.u**2) * upper32(pc * pc, V2) + stored(r.u, x, x)
    return x, local_bound(Error(var, upper32(np.abs(pc), aV)).accumulated(a_s), r, worst_case)


def weights_route(P: np.ndarray, own_softmax: tuple[np.ndarray, ...] | None, golden_softmax: Any) -> np.ndarray:
    """How far the weights that made the head outputs may lie from the weights ``P`` returned.

    A correct kernel need not return the very P of its P·V: FlashAttention's forward keeps P·V
    in an online accumulator and recomputes P = exp(s − LSE) for the backward; another rounds
    P differently.  Both Ps are valid routes from the same scores s, each within its own
    rounding allowance t = LAMBDA·sigma + worst of softmax(s) (the local attn_weights bound),
    so |P_used − P| ≤ t + |P − softmax(s)|: the measured distance where the scores are exposed
    (``own_softmax``: softmax(s) and its bound from the adapter's own scores), else 2t with t
    from the golden scores (``golden_softmax()``).  docs/tolerances.md "Local checks"."""
    if own_softmax is not None:
        ref, sig, wor = own_softmax
        with np.errstate(invalid="ignore"):
            return inf_for_nan(np.abs(P - ref) + Bound(sig, wor).tolerance(LAMBDA))
    _, sig, wor = golden_softmax()
    return 2.0 * Bound(sig, wor).tolerance(LAMBDA)


def concat(head_outputs: np.ndarray, r: Rounding, worst_case: bool) -> tuple[np.ndarray, Bound]:
    """concat = the adapter's head outputs merged: only their storage, var = u²·c² + U64²·c²."""
    ref = merge(head_outputs)
    return ref, local_bound(Error(stored(r.u, ref), np.zeros_like(ref)), r, worst_case)


def output(c: np.ndarray, w_o: np.ndarray, b_o: np.ndarray | None, r: Rounding,
           worst_case: bool) -> tuple[np.ndarray, Bound]:
    """y = c W_o + b_o from the adapter's own concat:

    var = u²·c² @ W_o² + u²·(|cW_o|² + |y|²) + U64²·y² + (σ·m)², worst = γ·m, m = |c|@|W_o| + |b_o|
    ((γ, σ) = :meth:`~.vocabulary.Rounding.accumulation` (H·D_v))."""
    cw = c @ w_o
    ref = cw if b_o is None else cw + b_o
    e = product(c, Error(r.u**2 * c**2), w_o, EXACT, 1.0, r.u, stored_as=(cw, ref),
                bias=b_o).accumulated(r.accumulation(w_o.shape[0]))
    return ref, local_bound(e, r, worst_case)
