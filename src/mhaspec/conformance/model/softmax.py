"""How errors move through the softmax: the propagation helpers of the forward and backward rules.

p_j = e^{s_j} / Σ_k e^{s_k} over the visible keys of a query row (docs/tolerances.md "The
bound", the ``attn_weights`` line and "Second order"):

* linearised, ``δp_j = p_j (δs_j − Σ_k p_k δs_k)``: :func:`softmax_rel2`, :func:`weights_sigma`;
* exactly, for score moves ``|δs_k| ≤ τ_k``: :func:`softmax_worst`, and what the linearisation
  misses, :func:`second_order`;
* the float32 softmax's own rounding: :func:`softmax_rounding`.

Arrays are (…, S): the keys of a row on the last axis.
"""

from __future__ import annotations

import numpy as np

from .vocabulary import LAMBDA, U64, inf_for_nan


def softmax_visible(s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """float64 softmax over S of the visible scores; masked entries and blind rows are 0."""
    x = np.where(visible, s, -np.inf)
    peak = np.max(x, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(visible, np.exp(np.minimum(x - peak, 0.0)), 0.0)
    return normalised(e)


def normalised(e: np.ndarray) -> np.ndarray:
    """``e`` (…, S) divided by its row sums; 0 in a row whose sum is not positive."""
    total = np.sum(e, axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


def rest_of_row(t: np.ndarray) -> np.ndarray:
    """Σ_{k≠j} t_k of the non-negative variance terms ``t`` of each row, as Σ_k t_k − t_j, at least 0."""
    return np.maximum(np.sum(t, axis=-1, keepdims=True) - t, 0.0)


def softmax_rel2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Relative variance (Var/p_j²) of p_j from independent score errors with variances
    ``sigma2_s`` (linearised): δp_j = p_j (δs_j − Σ_k p_k δs_k), so
    Var = p_j² ((1 − p_j)² σ_j² + Σ_{k≠j} p_k² σ_k²).  Relative, because p_j² underflows
    for the tiny weights of large logits."""
    return (1 - p) ** 2 * sigma2_s + rest_of_row(p**2 * sigma2_s)


def softmax_sigma2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Variance of p_j (see :func:`softmax_rel2`)."""
    return p**2 * softmax_rel2(p, sigma2_s)


def weights_sigma(p: np.ndarray, sigma2_s: np.ndarray, u: float, sum_sigma: float = 0.0) -> np.ndarray:
    """sigma of the weights: the score noise through the softmax, P's own storage rounding and the
    row sum's accumulation where it is a standard deviation (``sum_sigma`` = σ_acc(S + k), relative),
    ``p_j·sqrt(Var/p_j² + u² + U64² + sum_sigma²)`` (:func:`softmax_rel2`; +inf where it cannot be formed)."""
    return inf_for_nan(p * np.sqrt(softmax_rel2(p, sigma2_s) + u**2 + U64**2 + sum_sigma**2))


def visible_row_max(abs_s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """max_k |s_k| over the visible keys of each row (0 where none; the maximum of the visible ones and 0,
    without a masked copy of ``abs_s``)."""
    shape = np.broadcast_shapes(np.shape(abs_s), np.shape(visible))
    return np.max(np.broadcast_to(abs_s, shape), axis=-1, keepdims=True, where=np.broadcast_to(visible, shape),
                  initial=0.0)


def softmax_rounding(abs_s: np.ndarray, row_max: np.ndarray, a_s: float, u_acc: float) -> np.ndarray:
    """The relative error of a correct softmax in the accumulator, worst-case:
    ``a_s + u_acc·(|s_j| + max_k |s_k|)`` (the row sum's accumulation, γ_acc(S + k), or 0 where it
    is counted as a standard deviation, :func:`weights_sigma`; and exp of the shifted score;
    ``row_max``: :func:`visible_row_max`)."""
    return a_s + u_acc * (abs_s + row_max)


def score_moves(sigma2_s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """τ = LAMBDA·sqrt(σ_s²) where visible, 0 where masked: how far the scores may move."""
    return np.where(visible, LAMBDA * np.sqrt(sigma2_s), 0.0)


def others(a: np.ndarray) -> np.ndarray:
    """Σ_{k≠j} a_k for every j of each row of the non-negative ``a`` (NaN where the row is not finite).

    Not ``Σ_k a_k − a_j``: where a_j holds nearly all of its row, that difference is the sum's
    own rounding error, which can come out 0 and hide everything the other keys can do.  The
    row's largest term is taken out of the sum instead and added back for the other keys."""
    top_at = np.argmax(a, axis=-1)[..., None]
    top = np.take_along_axis(a, top_at, -1)
    rest = a.copy()
    np.put_along_axis(rest, top_at, 0.0, -1)
    rest_sum = rest.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        out = np.maximum((rest_sum - a) + top, 0.0)  # the terms but a_j: the others, and the top one
    np.put_along_axis(out, top_at, rest_sum, -1)
    return out


def softmax_worst(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Exact bound on |p'_j − p_j| when each visible score moves by at most t_j.

    p'_j = p_j / (p_j + R_j) with R_j = Σ_{k≠j} p_k e^{δ_k − δ_j}, so
    R_j ∈ [e^{−t_j} Σ_{k≠j} p_k e^{−t_k}, e^{t_j} Σ_{k≠j} p_k e^{t_k}]: a key that dominates
    its row (p_j ≈ 1) stays put whatever its own score does.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        tt = np.minimum(t, 350.0)
        up, down = np.exp(tt), np.exp(-tt)
        others_up, others_down = others(p * up), others(p * down)
        lo = p / (p + up * others_up)
        hi = p / (p + down * others_down)
        err = np.maximum(hi - p, p - lo)
    return np.where(p > 0, np.fmin(err, 1.0), 0.0)  # fmin: NaN (0/0, inf/inf) -> 1


#: Rows whose score movement X_j (see :func:`second_order`) stays at or below this take the
#: closed-form second-order bound, the others the exact pairwise one.  The closed form can be
#: about twice the exact second-order term, and that term, carried worst-case, adds up over the
#: keys in the head outputs; at this threshold it only applies where the term is negligible:
#: float32 and float64 runs (tolerances at most 0.5 % wider than the exact bound's on the catalog,
#: docs/tolerances.md), never the float16/bfloat16 ones.
SECOND_ORDER_CLOSED_FORM = 2.0**-10


def second_order(p: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """What the linearisation misses when scores move by up to ``tau``: the exact bound
    (:func:`softmax_worst`) less its first-order part p_j ℓ_j, ℓ_j = (1 − p_j) τ_j + Σ_{k≠j} p_k τ_k.

    Where every score of a row moves little, the closed form (docs/tolerances.md) is used
    instead.  With d_k = δ_k − Σ_m p_m δ_m (|d_k| ≤ ℓ_k, Σ_k p_k d_k = 0), Jensen and
    log y ≤ y − 1 give 0 ≤ log Σ_k p_k e^{δ_k} − Σ_k p_k δ_k ≤ Σ_k p_k (e^{d_k} − 1 − d_k)
    ≤ ρ = Σ_k p_k ℓ_k² e^{ℓ_k} / 2; so x = log p'_j − log p_j has |x| ≤ X_j = ℓ_j + ρ and
    |p'_j − p_j| − p_j ℓ_j ≤ p_j (ρ + X_j² e^{X_j} / 2).  It is never below the exact bound, is
    0 for a key that holds its whole row, and costs a few element-wise passes instead of two
    exponentials and four row sums."""
    ptau = p * tau
    row = np.sum(ptau, axis=-1, keepdims=True)
    ell = tau + row - 2 * ptau  # ℓ_j
    with np.errstate(over="ignore", invalid="ignore"):
        rho = 0.5 * np.sum(p * ell * ell * np.exp(np.minimum(ell, 350.0)), axis=-1, keepdims=True)
        x = ell + rho
        closed = p * (rho + 0.5 * x * x * np.exp(np.minimum(x, 350.0)))
    exact_rows = np.max(np.where(p > 0, x, 0.0), axis=-1) > SECOND_ORDER_CLOSED_FORM
    if not exact_rows.any():
        return closed
    rows = np.nonzero(exact_rows)
    pe, te = p[rows], tau[rows]
    exact = np.maximum(softmax_worst(pe, te) - pe * ell[rows], 0.0)
    closed[rows] = exact
    return closed
