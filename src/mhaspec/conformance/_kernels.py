"""Compiled chunk loops of the tolerance computation (optional: numba, the ``fast`` extra).

:func:`attention_chunk` computes, for one chunk of query rows, what
:func:`mhaspec.conformance.tolerance._attention_chunk_fast` computes with some seventy
NumPy passes over the chunk: the bounds of the scores and of the attention weights (steps 2
and 3 of docs/tolerances.md) and the operands of the head outputs' bound products (step 4),
in a few sweeps of each row that stay in the processor's L1 cache;
:func:`local_weights_chunk` does the same for the local attention-weights check
(:func:`mhaspec.conformance.tolerance._local_weights_fast`).  The formulas are the
same, term by term; what differs is only the order of the float64 roundings of the bounds
themselves (row sums added in another order than NumPy's pairwise one) and one exponential: the
closed-form second-order term takes ``exp(ℓ_j)·exp(ρ)·(1 + 2⁻⁵⁰)`` for ``exp(ℓ_j + ρ)``, never
less (each exponential is within one ulp), so it stays an upper bound.  The tolerances
differ from NumPy's in their last bits (tests/test_kernels.py measures by how much).

Everything here is imported only when a large case is judged and numba is installed
(:func:`mhaspec.conformance.tolerance._kernels`); ``import mhaspec`` never imports numba.
"""

import math

import numba as nb
from numba.core.errors import NumbaError

#: What a failed compilation raises: the caller then switches to the NumPy loops (same bounds).
ERRORS = (NumbaError,)

from .tolerance import LAMBDA, SECOND_ORDER_CLOSED_FORM, U64  # the model's own constants (compile-time here)

U64_2 = U64**2
#: exp(a)·exp(b)·EXP_PRODUCT >= exp(a + b): two exponentials within an ulp each, their product rounded
EXP_PRODUCT = 1 + 2.0**-50


#: Floating-point liberties allowed: sums reassociated (vectorised, in any order; the bounds' own
#: sums are of non-negative terms but one) and products fused with additions.  Never "no NaNs" or
#: "no infinities": a chunk with a value that is not finite must still say so.
FASTMATH = {"reassoc", "nsz", "contract"}


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def _emit(h, i, S, sig, wor, want_bounds, sig_out, wor_out, want_tol, ext_arrays, ext, ext_val, tol_out):
    """One row's sigma and worst into the bounds, and/or its tolerances LAMBDA·sigma + (worst + ext)."""
    if want_bounds:
        for j in range(S):
            sig_out[h, i, j] = sig[j]
            wor_out[h, i, j] = wor[j]
    if want_tol:
        if ext_arrays:
            for j in range(S):
                tol_out[h, i, j] = sig[j] * LAMBDA + (wor[j] + ext[h, i, j])
        else:
            for j in range(S):
                tol_out[h, i, j] = sig[j] * LAMBDA + (wor[j] + ext_val)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def _second_order_row(p, tau, ell, out, eel, ups, dns, spare, S):
    """tolerance._second_order of one row into ``out``: the closed form, or the exact pairwise bound
    less its first-order part where some X_j = ℓ_j + ρ of a key with p > 0 exceeds
    SECOND_ORDER_CLOSED_FORM.  ``ell`` holds ℓ; ``eel``, ``ups``, ``dns``, ``spare``: work rows."""
    rho = 0.0
    for j in range(S):  # the exponentials (not vectorised: a libm call each)
        el = ell[j]
        ex = math.exp(min(el, 350.0))
        eel[j] = ex
        rho += p[j] * el * el * ex
    rho *= 0.5
    erho = math.exp(min(rho, 350.0)) * EXP_PRODUCT
    xmax = 0.0
    for j in range(S):  # the closed form; X_j = ℓ_j + ρ over the keys with p > 0
        pj = p[j]
        x = ell[j] + rho
        xmax = max(xmax, x if pj > 0 else 0.0)
        out[j] = pj * (rho + 0.5 * x * x * (eel[j] * erho))
    if xmax <= SECOND_ORDER_CLOSED_FORM:
        return
    # the exact bound on this row; Σ_{k≠j} p_k e^{±τ_k} as tolerance._others: the row's largest
    # term out of the sum, added back for the other keys
    top_u, top_d, at_u, at_d = -1.0, -1.0, 0, 0
    for j in range(S):
        tt = min(tau[j], 350.0)
        eu = math.exp(tt)
        ed = math.exp(-tt)
        eel[j] = eu
        spare[j] = ed
        up = p[j] * eu
        dn = p[j] * ed
        ups[j] = up
        dns[j] = dn
        if up > top_u:
            top_u, at_u = up, j
        if dn > top_d:
            top_d, at_d = dn, j
    su = 0.0
    sd = 0.0
    for j in range(S):
        su += ups[j] if j != at_u else 0.0
        sd += dns[j] if j != at_d else 0.0
    for j in range(S):
        pj = p[j]
        ou = su if j == at_u else max((su - ups[j]) + top_u, 0.0)
        od = sd if j == at_d else max((sd - dns[j]) + top_d, 0.0)
        lo = pj / (pj + eel[j] * ou)
        hi = pj / (pj + spare[j] * od)
        e = max(hi - pj, pj - lo)
        e = e if e <= 1.0 else 1.0  # NaN (0/0, inf/inf) -> 1
        e = e if pj > 0 else 0.0
        out[j] = max(e - pj * ell[j], 0.0)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def attention_chunk(s, p, vis, m1, m2, c1, c2, u2, ua, g_s, floor, cap,
                    want_bounds, sig_s, wor_s, sig_p, wor_p,
                    want_tol, ext_arrays, ext_s, ext_s_val, ext_p, ext_p_val, tol_s, tol_p,
                    lhs, q, pp32, lhs32, pk_out, work):
    """Steps 2 and 3 of the golden bounds, and the operands of step 4, for a (heads, rows, S) chunk.

    ``m1``, ``m2``: the float32 products of the score variances and of |Q||K|ᵀ, ``c1``, ``c2`` their
    factors; ``vis`` the visibility.  Writes sigma and worst of the scores and weights into ``sig_s``
    … ``wor_p`` where ``want_bounds``, their tolerances ``LAMBDA·sigma + (worst + reference error)``
    into ``tol_s``, ``tol_p`` where ``want_tol`` (the errors from ``ext_s``, ``ext_p`` where
    ``ext_arrays``, otherwise the values ``ext_s_val``, ``ext_p_val``), and
    ``lhs`` = p²t² + (u² + U64²)p² + p_round², ``q`` = p²t², ``pk_out`` = Σ_S q, ``pp32`` = p² and
    ``lhs32`` = second + γ_S·p for the head outputs.  ``work``: ten rows of S float64; ``cap``: the
    largest worst part of a weight before its floor (1).
    Returns False where a value written is not finite."""
    n_heads, R, S = s.shape
    ts2, tau, ptau, ell = work[0], work[1], work[2], work[3]
    eel, sigp, ups, dns = work[4], work[5], work[6], work[7]
    sgs, wrs = work[8], work[9]
    stored = 2 * u2 + U64_2
    chk = 0.0
    for h in range(n_heads):
        for i in range(R):
            sr, pr_, mr1, mr2 = s[h, i], p[h, i], m1[h, i], m2[h, i]
            pk = 0.0
            row = 0.0
            rmax = 0.0
            for j in range(S):  # 2. scores; the weights' score variance t², τ = LAMBDA·t
                sj = sr[j]
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                s2 = c1 * mr1[j] + stored * (sj * sj)
                ws = c2 * mr2[j]
                t2 = ws * ws + s2
                ts2[j] = t2
                qq = (pj * pj) * t2
                q[h, i, j] = qq
                pk += qq
                rmax = max(rmax, abs(sj) * v)
                ta = math.sqrt(t2) * LAMBDA * v
                tau[j] = ta
                pt = pj * ta
                ptau[j] = pt
                row += pt
                sg = math.sqrt(s2)
                wr = ws + floor
                sgs[j] = sg
                wrs[j] = wr
                chk += sg + wr
            _emit(h, i, S, sgs, wrs, want_bounds, sig_s, wor_s, want_tol, ext_arrays, ext_s, ext_s_val, tol_s)
            pk_out[h, i] = pk
            for j in range(S):  # 3. the weights' sigma; ℓ of the second-order term
                pj = pr_[j]
                d = max(pk - q[h, i, j], 0.0)
                sigp[j] = pj * math.sqrt((1.0 - pj) * (1.0 - pj) * ts2[j] + d + u2 + U64_2)
                ell[j] = tau[j] + row - 2 * ptau[j]
            _second_order_row(pr_, tau, ell, ptau, eel, ups, dns, sgs, S)
            for j in range(S):  # the weights' worst part; the head outputs' operands
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                sec = ptau[j]
                pr = pj * (g_s + ua * (abs(sr[j]) + rmax))
                w = min(pr + sec, cap)
                wr = (w + floor) * v
                wrs[j] = wr
                pp = pj * pj
                lh = q[h, i, j] + (u2 + U64_2) * pp + pr * pr
                lhs[h, i, j] = lh
                pp32[h, i, j] = pp
                lhs32[h, i, j] = sec + g_s * pj
                chk += wr + sigp[j] + lh
            _emit(h, i, S, sigp, wrs, want_bounds, sig_p, wor_p, want_tol, ext_arrays, ext_p, ext_p_val, tol_p)
    return math.isfinite(chk)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def local_weights_chunk(s, vis, u2, ua, g_s, floor, ref, sig, wor, work):
    """The local attention-weights check of a (heads, rows, S) chunk from the adapter's own scores ``s``
    (tolerance._local_weights_fast): the float64 softmax of the visible scores into ``ref`` (a row with
    no visible key: 0), the bound of its own rounding and of the scores' storage rounding into ``sig``
    and ``wor``.  Masked scores (often -inf) take no part.  ``work``: eight rows of S float64.
    Returns False where a visible score or a value written is not finite."""
    n_heads, R, S = s.shape
    ts2, tau, ptau, ell = work[0], work[1], work[2], work[3]
    eel, ups, dns, spare = work[4], work[5], work[6], work[7]
    stored = U64_2 + u2
    chk = 0.0
    for h in range(n_heads):
        for i in range(R):
            sr, pr_ = s[h, i], ref[h, i]
            peak = -math.inf
            for j in range(S):
                if vis[h, i, j]:
                    peak = max(peak, sr[j])
                    chk += sr[j]
            if not math.isfinite(peak):
                peak = 0.0
            total = 0.0
            for j in range(S):
                e = math.exp(min(sr[j] - peak, 0.0)) if vis[h, i, j] else 0.0
                pr_[j] = e
                total += e
            for j in range(S):
                pr_[j] = pr_[j] / total if total > 0 else 0.0
            pk = 0.0
            row = 0.0
            rmax = 0.0
            for j in range(S):  # the scores' storage rounding t², τ = LAMBDA·t
                v = 1.0 if vis[h, i, j] else 0.0
                sj = sr[j] if vis[h, i, j] else 0.0
                pj = pr_[j]
                t2 = (sj * sj) * stored
                ts2[j] = t2
                pk += (pj * pj) * t2
                rmax = max(rmax, abs(sj))
                ta = math.sqrt(t2) * LAMBDA * v
                tau[j] = ta
                pt = pj * ta
                ptau[j] = pt
                row += pt
            for j in range(S):  # sigma; ℓ of the second-order term
                pj = pr_[j]
                t2 = ts2[j]
                d = max(pk - (pj * pj) * t2, 0.0)
                sg = pj * math.sqrt((1.0 - pj) * (1.0 - pj) * t2 + d + u2 + U64_2)
                sig[h, i, j] = sg
                chk += sg
                ell[j] = tau[j] + row - 2 * ptau[j]
            _second_order_row(pr_, tau, ell, ptau, eel, ups, dns, spare, S)
            for j in range(S):  # the worst part: the softmax's own rounding and the second-order term
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                sj = sr[j] if vis[h, i, j] else 0.0
                w = (pj * (g_s + ua * (abs(sj) + rmax)) + ptau[j] + floor) * v
                wor[h, i, j] = w
                chk += w
    return math.isfinite(chk)
