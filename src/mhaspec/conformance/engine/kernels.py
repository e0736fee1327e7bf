"""Compiled chunk loops of the tolerance computation (optional: numba, the ``fast`` extra).

:func:`attention_chunk` computes, for one chunk of query rows, what
:func:`mhaspec.conformance.engine.inplace.attention_chunk` computes with some seventy
NumPy passes over the chunk (the model's :func:`mhaspec.conformance.model.forward.scores`,
``weights`` and the operands of ``head_outputs``' bound products), in a few sweeps of each
row that stay in the processor's L1 cache;
:func:`local_weights_chunk` does the same for the local attention-weights check
(:func:`mhaspec.conformance.engine.inplace.local_weights`), :func:`local_scores_chunk` and
:func:`local_outputs_operands` for the element-wise passes of the local scores and head-outputs
checks.  The formulas are the same, term by term; what differs is only the order of the float64
roundings of the bounds themselves (row sums added in another order than NumPy's pairwise one,
products fused with additions) and the exponentials: :func:`_exp`, this module's own, within
two ulps like numpy's (libm's ``exp`` is a call per element, which keeps a loop from being
vectorised), and ``exp(ℓ_j)·exp(ρ)·EXP_PRODUCT`` for ``exp(ℓ_j + ρ)`` in the closed-form
second-order term (never less).  The tolerances differ from NumPy's in their last bits
(tests/test_kernels.py measures by how much).  The loops are written so that LLVM vectorises
them: no floating-point max reductions (:func:`_largest`), no index searches.

Everything here is imported only when a large case is judged and numba is installed
(:func:`mhaspec.conformance.engine.compiled.kernels_for_shape`); ``import mhaspec`` never imports numba.
"""

import math
import threading
from typing import Any

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.core.errors import NumbaError
from numba.core.registry import cpu_target
from numba.extending import intrinsic

#: What a failed compilation raises: the caller then switches to the NumPy loops (same bounds).
ERRORS = (NumbaError,)

from ..model.softmax import SECOND_ORDER_CLOSED_FORM  # noqa: E402 (the model's own constants, compile-time here)
from ..model.vocabulary import LAMBDA, U64  # noqa: E402

U64_2 = U64**2
#: exp(a)·exp(b)·EXP_PRODUCT >= exp(a + b): two exponentials (:func:`_exp`) within two ulps each,
#: their product rounded
EXP_PRODUCT = 1 + 2.0**-49


#: Floating-point liberties allowed: sums reassociated (vectorised, in any order; the bounds' own
#: sums are of non-negative terms but one) and products fused with additions.  Never "no NaNs" or
#: "no infinities": a chunk with a value that is not finite must still say so.
FASTMATH = {"reassoc", "nsz", "contract"}


@intrinsic
def _as_float64(typingctx, bits):  # pragma: no cover - compiled
    """The float64 whose bit pattern is the int64 ``bits`` (a bit cast, vectorisable)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@intrinsic
def _bits(typingctx, x):  # pragma: no cover - compiled
    """The bit pattern of the float64 ``x`` as an int64 (a bit cast, vectorisable)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


LOG2E = 1.4426950408889634
#: ln 2 in two parts (fdlibm's): LN2_HI has 21 trailing zero bits, so n·LN2_HI is exact for |n| < 2^21
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10


@nb.njit(nogil=True, error_model="numpy", fastmath={"nsz", "contract"})
def _exp(x):
    """exp(x), vectorisable (libm's ``exp`` is a call per element, which keeps a loop scalar): within one
    ulp of libm's and within two (EXP_ULPS) of the correctly rounded value (tests/test_kernels.py),
    subnormal results included; NaN for NaN, inf above 709.79, 0 below -745.2.  x = n·ln2 + r with
    |r| <= ln2/2 (Cody-Waite), exp(r) by its Taylor polynomial to r^13 (remainder < 2^-57), times 2^n
    as two powers of two so that a subnormal result is rounded once.  Compiled without ``reassoc``:
    its callers' liberties must not rewrite the reduction (numba keeps each function's flags)."""
    x = min(max(x, -746.0), 710.0)
    n = math.floor(x * LOG2E + 0.5)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = 1.0 / 6227020800.0
    p = 1.0 / 479001600.0 + r * p
    p = 1.0 / 39916800.0 + r * p
    p = 1.0 / 3628800.0 + r * p
    p = 1.0 / 362880.0 + r * p
    p = 1.0 / 40320.0 + r * p
    p = 1.0 / 5040.0 + r * p
    p = 1.0 / 720.0 + r * p
    p = 1.0 / 120.0 + r * p
    p = 1.0 / 24.0 + r * p
    p = 1.0 / 6.0 + r * p
    p = 0.5 + r * p
    p = 1.0 + r * p
    p = 1.0 + r * p
    k = np.int64(n)
    k1 = k >> 1
    return p * _as_float64((k1 + 1023) << 52) * _as_float64((k - k1 + 1023) << 52)


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
def _largest(a, S):
    """max(0, a_0 … a_{S-1}) of non-negative terms, as a vectorisable integer reduction: non-negative
    float64s order as their bit patterns (a float max reduction does not vectorise unless NaNs are
    ruled out, and they are not: a NaN, whatever it gives here, also reaches the caller's finite check)."""
    top = 0
    for j in range(S):
        top = max(top, _bits(a[j]))
    return _as_float64(top)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def _others_sum(a, S):
    """(Σ_{k≠j} a_k where a_j is the row's largest term, that term) of the non-negative ``a``:
    model.softmax.others without an index (ties: the largest term counted once less), so that
    Σ_{k≠j} a_k = sum for a key j that holds the top, (sum − a_j) + top for the others."""
    top = _largest(a, S)
    rest = 0.0
    ties = 0.0
    for j in range(S):
        x = a[j]
        rest += x if x < top else 0.0
        ties += 1.0 if x >= top else 0.0
    return rest + max(ties - 1.0, 0.0) * top, top


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def _second_order_row(p, tau, ell, out, eel, ups, dns, spare, S):
    """model.softmax.second_order of one row into ``out``: the closed form, or the exact pairwise bound
    less its first-order part where some X_j = ℓ_j + ρ of a key with p > 0 exceeds
    SECOND_ORDER_CLOSED_FORM.  ``ell`` holds ℓ (>= 0); ``eel``, ``ups``, ``dns``, ``spare``: work rows."""
    rho = 0.0
    for j in range(S):  # the exponentials
        el = ell[j]
        ex = _exp(min(el, 350.0))
        eel[j] = ex
        rho += p[j] * el * el * ex
        spare[j] = el if p[j] > 0 else 0.0
    rho *= 0.5
    if _largest(spare, S) + rho <= SECOND_ORDER_CLOSED_FORM:  # X_j over the keys with p > 0
        erho = _exp(min(rho, 350.0)) * EXP_PRODUCT
        for j in range(S):  # the closed form
            x = ell[j] + rho
            out[j] = p[j] * (rho + 0.5 * x * x * (eel[j] * erho))
        return
    # the exact bound on this row; Σ_{k≠j} p_k e^{±τ_k} as model.softmax.others: the row's largest
    # term out of the sum, added back for the other keys
    for j in range(S):
        tt = min(tau[j], 350.0)
        eu = _exp(tt)
        ed = _exp(-tt)
        eel[j] = eu
        spare[j] = ed
        ups[j] = p[j] * eu
        dns[j] = p[j] * ed
    su, top_u = _others_sum(ups, S)
    sd, top_d = _others_sum(dns, S)
    for j in range(S):
        pj = p[j]
        up = ups[j]
        dn = dns[j]
        ou = su if up >= top_u else max((su - up) + top_u, 0.0)
        od = sd if dn >= top_d else max((sd - dn) + top_d, 0.0)
        lo = pj / (pj + eel[j] * ou)
        hi = pj / (pj + spare[j] * od)
        e = max(hi - pj, pj - lo)
        e = e if e <= 1.0 else 1.0  # NaN (0/0, inf/inf) -> 1
        e = e if pj > 0 else 0.0
        out[j] = max(e - pj * ell[j], 0.0)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def attention_chunk(s, p, vis, m1, m2, c1, c2, w_d, s_d, u2, ua, w_s, s_s, floor, cap,
                    want_bounds, sig_s, wor_s, sig_p, wor_p,
                    want_tol, ext_arrays, ext_s, ext_s_val, ext_p, ext_p_val, tol_s, tol_p,
                    lhs, q, pp32, lhs32, pk_out, work, S_seen):
    """Steps 2 and 3 of the golden bounds, and the operands of step 4, for a (heads, rows, S) chunk.

    ``m1``, ``m2``: the float32 products of the score variances and of |Q||K|ᵀ, ``c1``, ``c2`` their
    factors, ``w_d``/``s_d`` and ``w_s``/``s_s`` the score sums' and the softmax's and P·V's
    accumulation coefficients, worst-case and standard deviation (model.vocabulary.Acc); ``vis``
    the visibility.  Writes sigma and worst of the scores and weights into ``sig_s``
    … ``wor_p`` where ``want_bounds``, their tolerances ``LAMBDA·sigma + (worst + reference error)``
    into ``tol_s``, ``tol_p`` where ``want_tol`` (the errors from ``ext_s``, ``ext_p`` where
    ``ext_arrays``, otherwise the values ``ext_s_val``, ``ext_p_val``), and
    ``lhs`` = p²t² + (u² + U64²)p² + p_round², ``q`` = p²t², ``pk_out`` = Σ_S q, ``pp32`` = p² and
    ``lhs32`` = second + γ_S·p for the head outputs (``lhs`` also holds σ_S²·p).  ``work``: ten rows of
    S float64; ``cap``: the largest worst part of a weight before its floor (1).  ``S_seen``: the keys
    the chunk's rows see (spec.masks.seen_keys): the loops and the operands stop there (``m1``, ``m2``,
    ``lhs``, ``q``, ``pp32``, ``lhs32`` may be that wide); every later key, masked in every row, gets
    sigma and worst 0 (its tolerance: the reference error), a masked weight's own bounds.
    Returns False where a value written is not finite."""
    n_heads, R, S = s.shape
    ts2, tau, ptau, ell = work[0], work[1], work[2], work[3]
    eel, sigp, ups, dns = work[4], work[5], work[6], work[7]
    sgs, wrs = work[8], work[9]
    stored = 2 * u2 + U64_2
    chk = 0.0
    for j in range(S_seen, S):  # the keys no row sees: bounds 0 (the loops below never write there)
        sgs[j] = 0.0
        wrs[j] = 0.0
        sigp[j] = 0.0
    for h in range(n_heads):
        for i in range(R):
            sr, pr_, mr1, mr2 = s[h, i], p[h, i], m1[h, i], m2[h, i]
            pk = 0.0
            row = 0.0
            top = 0
            for j in range(S_seen):  # 2. scores; the weights' score variance t², τ = LAMBDA·t
                sj = sr[j]
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                m = c2 * mr2[j]
                sa = s_d * m
                s2 = c1 * mr1[j] + stored * (sj * sj) + sa * sa
                ws = w_d * m
                t2 = ws * ws + s2
                ts2[j] = t2
                qq = (pj * pj) * t2
                q[h, i, j] = qq
                pk += qq
                top = max(top, _bits(abs(sj) * v))  # the row's largest visible |s| (_largest)
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
            rmax = _as_float64(top)
            pk_out[h, i] = pk
            for j in range(S_seen):  # 3. the weights' sigma; ℓ of the second-order term
                pj = pr_[j]
                d = max(pk - q[h, i, j], 0.0)
                sigp[j] = pj * math.sqrt((1.0 - pj) * (1.0 - pj) * ts2[j] + d + (u2 + U64_2 + s_s * s_s))
                ell[j] = tau[j] + row - 2 * ptau[j]
            _second_order_row(pr_, tau, ell, ptau, eel, ups, dns, sgs, S_seen)
            for j in range(S_seen):  # the weights' worst part; the head outputs' operands
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                sec = ptau[j]
                pr = pj * (w_s + ua * (abs(sr[j]) + rmax))
                w = min(pr + sec, cap)
                wr = (w + floor) * v
                wrs[j] = wr
                pp = pj * pj
                p_all = pr + s_s * pj  # all of the softmax's own rounding
                lh = q[h, i, j] + (u2 + U64_2) * pp + p_all * p_all + (s_s * s_s) * pj
                lhs[h, i, j] = lh
                pp32[h, i, j] = pp
                lhs32[h, i, j] = sec + w_s * pj
                chk += wr + sigp[j] + lh
            _emit(h, i, S, sigp, wrs, want_bounds, sig_p, wor_p, want_tol, ext_arrays, ext_p, ext_p_val, tol_p)
    return math.isfinite(chk)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def local_weights_chunk(s, vis, u2, ua, w_s, s_s, floor, ref, sig, wor, work, S_seen):
    """The local attention-weights check of a (heads, rows, S) chunk from the adapter's own scores ``s``
    (inplace.local_weights): the float64 softmax of the visible scores into ``ref`` (a row with
    no visible key: 0), the bound of its own rounding and of the scores' storage rounding into ``sig``
    and ``wor``.  Masked scores (often -inf) take no part.  ``work``: eight rows of S float64.
    ``S_seen``: the keys the chunk's rows see (spec.masks.seen_keys): the loops stop there, and every later
    key gets a masked key's 0 in ``ref``, ``sig`` and ``wor``.
    Returns False where a visible score or a value written is not finite."""
    n_heads, R, S = s.shape
    ts2, tau, ptau, ell = work[0], work[1], work[2], work[3]
    eel, ups, dns, spare = work[4], work[5], work[6], work[7]
    stored = U64_2 + u2
    chk = 0.0
    for h in range(n_heads):
        for i in range(R):
            sr, pr_ = s[h, i], ref[h, i]
            for j in range(S_seen, S):  # the keys no row sees
                pr_[j] = 0.0
                sig[h, i, j] = 0.0
                wor[h, i, j] = 0.0
            peak = -math.inf
            for j in range(S_seen):
                if vis[h, i, j]:
                    peak = max(peak, sr[j])
                    chk += sr[j]
            if not math.isfinite(peak):
                peak = 0.0
            total = 0.0
            for j in range(S_seen):
                e = _exp(min(sr[j] - peak, 0.0)) if vis[h, i, j] else 0.0
                pr_[j] = e
                total += e
            for j in range(S_seen):
                pr_[j] = pr_[j] / total if total > 0 else 0.0
            pk = 0.0
            row = 0.0
            top = 0
            for j in range(S_seen):  # the scores' storage rounding t², τ = LAMBDA·t
                v = 1.0 if vis[h, i, j] else 0.0
                sj = sr[j] if vis[h, i, j] else 0.0
                pj = pr_[j]
                t2 = (sj * sj) * stored
                ts2[j] = t2
                pk += (pj * pj) * t2
                top = max(top, _bits(abs(sj)))  # the row's largest visible |s| (_largest)
                ta = math.sqrt(t2) * LAMBDA * v
                tau[j] = ta
                pt = pj * ta
                ptau[j] = pt
                row += pt
            rmax = _as_float64(top)
            for j in range(S_seen):  # sigma; ℓ of the second-order term
                pj = pr_[j]
                t2 = ts2[j]
                d = max(pk - (pj * pj) * t2, 0.0)
                sg = pj * math.sqrt((1.0 - pj) * (1.0 - pj) * t2 + d + (u2 + U64_2 + s_s * s_s))
                sig[h, i, j] = sg
                chk += sg
                ell[j] = tau[j] + row - 2 * ptau[j]
            _second_order_row(pr_, tau, ell, ptau, eel, ups, dns, spare, S_seen)
            for j in range(S_seen):  # the worst part: the softmax's own rounding and the second-order term
                pj = pr_[j]
                v = 1.0 if vis[h, i, j] else 0.0
                sj = sr[j] if vis[h, i, j] else 0.0
                w = (pj * (w_s + ua * (abs(sj) + rmax)) + ptau[j] + floor) * v
                wor[h, i, j] = w
                chk += w
    return math.isfinite(chk)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def local_scores_chunk(ref, m_sig, m_wor, scale, c_sig, stored, c_wor, c_acc, floor, sig, wor, S_seen):
    """The local scores check of a (heads, rows, S) chunk once its products are formed
    (inplace.local_scores): ``ref`` (q·Kᵀ in float64) scaled in place, ``sig`` =
    sqrt(c_sig·m_sig + stored·ref² + (c_acc·m_wor)²), ``wor`` = c_wor·m_wor + floor, from the float32 products
    ``m_sig`` (q²·K²ᵀ) and ``m_wor`` (|q|·|K|ᵀ) in one sweep.  ``S_seen``: the keys the chunk's rows see
    (spec.masks.seen_keys; the products ``m_sig``, ``m_wor`` may be that wide, ``ref`` formed that far): masked
    scores are not compared, and every later key gets 0 in ``ref``, ``sig`` and ``wor``.
    False where a value is not finite."""
    n_heads, R, S = ref.shape
    chk = 0.0
    for h in range(n_heads):
        for i in range(R):
            rr, ms, mw, so, wo = ref[h, i], m_sig[h, i], m_wor[h, i], sig[h, i], wor[h, i]
            for j in range(S_seen, S):  # the keys no row sees
                rr[j] = 0.0
                so[j] = 0.0
                wo[j] = 0.0
            for j in range(S_seen):
                x = rr[j] * scale
                rr[j] = x
                a = c_acc * mw[j]
                sg = math.sqrt(c_sig * ms[j] + stored * (x * x) + a * a)
                wr = c_wor * mw[j] + floor
                so[j] = sg
                wo[j] = wr
                chk += x + sg + wr
    return math.isfinite(chk)


@nb.njit(nogil=True, error_model="numpy", fastmath=FASTMATH)
def local_outputs_operands(pc, pp32, apc32):
    """The float32 operands p² and |p| of the local head-outputs check's bound products, from the
    adapter's own (heads, rows, S) attention weights ``pc``, in one sweep
    (compiled.local_outputs).  False where a weight is not finite."""
    n_heads, R, S = pc.shape
    chk = 0.0
    for h in range(n_heads):
        for i in range(R):
            pr, pp, ap = pc[h, i], pp32[h, i], apc32[h, i]
            for j in range(S):
                x = pr[j]
                pp[j] = x * x
                ap[j] = abs(x)
                chk += x
    return math.isfinite(chk)



@nb.njit(nogil=True, error_model="numpy")
def ordinary_stage(v, g, tol, sig, wor, vis, use_vis, want_z, check_float32):
    """compare.compare_stage's figures for a passing stage in one sweep of (N, R, C) arrays of any
    strides (broadcast ones too): (ok, compared, max |error|, max relative error, worst
    error/tolerance, its flat index in the whole array, Σ z², elements with sigma > 0, whether some
    compared |golden| exceeds its tolerance).  With ``use_vis`` only the elements where ``vis`` is
    nonzero are compared.  ``ok`` is False as soon as an element is out of the ordinary (a value
    or error not finite, a negative or NaN tolerance or sigma, an error above its tolerance or
    nonzero where the tolerance is 0, or, with ``check_float32``, a value not representable in
    float32): the caller then judges the stage by NumPy, with every message.  Compiled without
    fast-math: the maxima and the first index of the largest ratio are NumPy's exactly; Σ z² is
    summed in another order."""
    N, R, C = v.shape
    max_err = 0.0
    rel_max = 0.0
    worst = -1.0
    at = 0
    z2 = 0.0
    n_z = 0
    compared = 0
    above = False
    flat = -1
    for n in range(N):
        for i in range(R):
            for j in range(C):
                flat += 1
                if use_vis and vis[n, i, j] == 0:
                    continue
                x = v[n, i, j]
                if check_float32 and np.float64(np.float32(x)) != x:
                    return False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False
                gv = g[n, i, j]
                e = abs(x - gv)
                t = tol[n, i, j]
                if not (math.isfinite(e) and t >= 0.0):
                    return False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False
                if t > 0.0:
                    r = e / t
                    if r > 1.0:
                        return False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False
                elif e > 0.0:
                    return False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False
                else:
                    r = 0.0
                compared += 1
                if r > worst:
                    worst = r
                    at = flat
                if e > max_err:
                    max_err = e
                a = abs(gv)
                if a > t:
                    above = True
                if a > 0.0:
                    q = e / a
                elif e > 0.0:
                    q = math.inf
                else:
                    q = 0.0
                if q > rel_max:
                    rel_max = q
                if want_z:
                    s = sig[n, i, j]
                    if s > 0.0:
                        z = max(e - wor[n, i, j], 0.0) / s
                        z2 += z * z
                        n_z += 1
                    elif not s == 0.0:
                        return False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False
    return True, compared, max_err, rel_max, worst, at, z2, n_z, above


def _array(dtype: Any, ndim: int, layout: str = "C", readonly: bool = False) -> types.Array:
    """numba's type of an aligned ``ndim``-dimensional ``dtype`` array (``layout`` "A": any strides)."""
    return types.Array(dtype, ndim, layout, readonly=readonly)


_F8, _F4, _B1, _I8 = types.float64, types.float32, types.boolean, types.int64
_RO64, _RO32, _RW64, _RW32 = _array(_F8, 3, readonly=True), _array(_F4, 3, readonly=True), _array(_F8, 3), _array(_F4, 3)
_ROWS = _array(_F8, 2)
#: an operand a call site may pass broadcast or strided (a visibility, a reference error): any strides
_ANY64, _ANY_BOOL = _array(_F8, 3, "A", readonly=True), _array(_B1, 3, "A", readonly=True)

#: Each kernel's one signature, compiled on its first use (:func:`declared`) so that numba compiles
#: it, and each helper it calls, once per process: the argument types of compiled.py's call sites,
#: read-only where the kernel only reads (a writeable array converts to it; not where the kernel
#: hands the array's rows to a helper that another kernel calls with writeable ones, which would
#: compile the helper twice), any strides where a call site may pass a broadcast view (a contiguous
#: array converts to it).  Typed by their arguments instead, the kernels compiled once per layout
#: and write flag met: 12 signatures in a float32 run, ``_emit`` and ``ordinary_stage`` twice each.
SIGNATURES = {
    "attention_chunk": (_RW64, _RW64, _ANY_BOOL, _RO32, _RO32, *(_F8,) * 10,
                        _B1, _RW64, _RW64, _RW64, _RW64,
                        _B1, _B1, _ANY64, _F8, _ANY64, _F8, _RW64, _RW64,
                        _RW64, _RW64, _RW32, _RW32, _ROWS, _ROWS, _I8),
    "local_weights_chunk": (_RO64, _array(_B1, 3, readonly=True), *(_F8,) * 5, _RW64, _RW64, _RW64, _ROWS, _I8),
    "local_scores_chunk": (_RW64, _RO32, _RO32, *(_F8,) * 6, _RW64, _RW64, _I8),
    "local_outputs_operands": (_RO64, _RW32, _RW32),
    "ordinary_stage": (*(_RO64,) * 5, _array(types.uint8, 3, "A", readonly=True), _B1, _B1, _B1),
}


def declared(name: str, args: tuple[Any, ...]) -> Any:
    """The kernel ``name``; on its first call, compiled for its signature in :data:`SIGNATURES` and held
    to it where ``args`` convert to it (numba converts a writeable or contiguous array to the read-only
    or any-strides type), so that another layout met later compiles nothing.  Where the first call's
    arguments do not convert (an array of other strides where the signature says contiguous: a view
    an adapter returned, say), numba types each call's arguments as it comes, as without a signature."""
    fn = globals()[name]
    if isinstance(fn, Dispatcher) and name not in _DECLARED:
        with _DECLARE_LOCK:
            if name not in _DECLARED:
                signature = SIGNATURES[name]
                if _converts(args, signature):
                    fn.compile(signature)
                    fn.disable_compile()
                    _HELD.add(name)
                _DECLARED.add(name)
    return fn


def _converts(args: tuple[Any, ...], signature: tuple[Any, ...]) -> bool:
    """Whether numba converts the values ``args`` to the types ``signature``."""
    typing = cpu_target.typing_context
    return len(args) == len(signature) and all(typing.can_convert(nb.typeof(a), t) is not None
                                               for a, t in zip(args, signature))


def call(name: str, *args: Any) -> Any:
    """``name(*args)`` by its declared signature (:func:`declared`), or, where they do not convert to it or
    to another signature compiled already, by the arguments' own types, compiled then."""
    fn = declared(name, args)
    try:
        return fn(*args)
    except TypeError:  # no matching definition (compilation held): these arguments' types, compiled once
        if name not in _HELD or not isinstance(fn, Dispatcher):
            raise
        with _DECLARE_LOCK:
            fn.disable_compile(False)
            try:
                fn.compile(tuple(nb.typeof(a) for a in args))
            finally:
                fn.disable_compile()
        return fn(*args)


#: The kernels past their first call (:func:`declared`), and those of them held to their declared signature
_DECLARED: set[str] = set()
_HELD: set[str] = set()
_DECLARE_LOCK = threading.Lock()
