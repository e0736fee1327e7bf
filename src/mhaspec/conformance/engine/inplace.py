"""The in-place NumPy path of the chunk loops: the model's rules, the same formulas, faster.

The functions here compute exactly what :func:`mhaspec.conformance.model.forward.attention_chunk`
and the local rules of :mod:`mhaspec.conformance.model.local` compute (tests/test_tolerance_model.py
compares them: the same bounds to the rounding of the bounds' own arithmetic), but in place on
work arrays reused from chunk to chunk, and without ``np.where`` on chunks that need no mask:
``np.where`` costs about ten in-place passes, a fresh array a page fault per 4 KiB.  Masked
entries need no mask where the formula multiplies by the attention weight, which is 0 there.
A chunk where anything is not finite (an adapter's own wild values) is left to the model's
general rules, which handle every special value; the functions here then return False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...spec.masks import seen_keys
from ..compare import Scratch
from ..model.forward import AttentionConstants, ChunkOut
from ..model.softmax import SECOND_ORDER_CLOSED_FORM
from ..model.variants import LseShared
from ..model.vocabulary import LAMBDA, U32, U64, Acc, Pair, gamma, inf_for_nan, stored, swap, upper32


def finite(*arrays: np.ndarray) -> bool:
    """Every value finite: one reduction each, the sum, which is NaN or ±inf when a value is.  A sum
    of finite values that overflows says False too, and such a chunk takes the general path (the
    same bounds, only slower)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return all(a.size == 0 or np.isfinite(a.sum()) for a in arrays)


def product32(a: np.ndarray, b: Pair, factor: float, out: np.ndarray, length: int | None = None) -> bool:
    """``out = factor · upper32(a, b, length)`` (float64), False when the float32 product is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        m = a.astype(np.float32, copy=False) @ b.f32
    if not np.isfinite(m.max()):
        return False
    n = a.shape[-1] if length is None else length
    np.multiply(m, factor * (1 + 2 * float(gamma(n + 2, U32))), out=out, dtype=np.float64)
    return True


def query_operand(Q: np.ndarray, tQ2: np.ndarray, u2: float, buf: Scratch) -> np.ndarray:
    """``[T_Q²/u², Q²]`` (B·H, T, 2·D_k), the left operand of the score variances' float32 product
    (:class:`~mhaspec.conformance.model.forward.KeySide`'s ``KK`` on the right), written straight in
    float32: each float64 value rounded once, as ``astype`` would, without the float64 copies."""
    D = Q.shape[-1]
    qq = buf("a_qq", (*Q.shape[:-1], 2 * D), np.float32)
    np.divide(tQ2, u2, out=qq[..., :D])
    np.multiply(Q, Q, out=qq[..., D:])
    return qq


def row_max_visible(x: np.ndarray, visf: np.ndarray | None, buf: Scratch) -> np.ndarray:
    """max over the visible entries of each row of the non-negative ``x`` (0 where none)."""
    if visf is None:
        return x.max(axis=-1, keepdims=True)
    t = buf("rowmax", x.shape)
    np.multiply(x, visf, out=t)
    return t.max(axis=-1, keepdims=True)


def second_order_into(p: np.ndarray, tau: np.ndarray, positive: np.ndarray | None, out: np.ndarray,
                       buf: Scratch) -> None:
    """:func:`second_order` (``p``, ``tau`` finite, non-negative) into ``out``; ``positive``:
    where p > 0, None when it is everywhere."""
    shape = p.shape
    ptau = buf("so_ptau", shape)
    np.multiply(p, tau, out=ptau)
    row = ptau.sum(axis=-1, keepdims=True)
    ell = buf("so_ell", shape)
    np.add(tau, row, out=ell)
    ptau *= 2
    ell -= ptau  # ℓ = τ + row − 2pτ >= τ(1 − p) >= 0
    with np.errstate(over="ignore", invalid="ignore"):
        ell_max = (ell.max(axis=-1) if positive is None
                   else np.max(np.multiply(ell, positive, out=buf("so_pos", shape)), axis=-1))
        if (ell_max > SECOND_ORDER_CLOSED_FORM).all():  # every row takes the exact bound (X >= ℓ)
            exact_second_into(p, tau, ell, positive, out, buf)
            return
        t = buf("so_t", shape)
        np.minimum(ell, 350.0, out=t)
        np.exp(t, out=t)
        e = buf("so_e", shape)
        np.multiply(p, ell, out=e)
        e *= ell
        e *= t
        rho = 0.5 * e.sum(axis=-1, keepdims=True)
        x = buf("so_x", shape)
        np.add(ell, rho, out=x)
        np.minimum(x, 350.0, out=t)
        np.exp(t, out=t)
        np.multiply(x, 0.5, out=out)
        out *= x
        out *= t
        out += rho
        out *= p
        x_max = (x.max(axis=-1) if positive is None
                 else np.max(np.multiply(x, positive, out=buf("so_pos", shape)), axis=-1))
    exact_rows = x_max > SECOND_ORDER_CLOSED_FORM
    if not exact_rows.any():
        return
    if exact_rows.all():
        exact_second_into(p, tau, ell, positive, out, buf)
        return
    rows = np.nonzero(exact_rows)
    sub = np.empty(p[rows].shape)
    exact_second_into(p[rows], tau[rows], ell[rows], None if positive is None else positive[rows], sub,
                       Scratch())
    out[rows] = sub


def others_inplace(a: np.ndarray, buf: Scratch) -> None:
    """:func:`~mhaspec.conformance.model.softmax.others` of ``a`` into ``a`` itself, the same
    operations in the same order (the same numbers), with its copy in a work array instead of
    three fresh ones (a page fault per 4 KiB each)."""
    top_at = np.argmax(a, axis=-1)[..., None]
    top = np.take_along_axis(a, top_at, -1)
    rest = buf("others_rest", a.shape)
    np.copyto(rest, a)
    np.put_along_axis(rest, top_at, 0.0, -1)
    rest_sum = rest.sum(axis=-1, keepdims=True)
    np.subtract(rest_sum, a, out=a)
    a += top
    np.maximum(a, 0.0, out=a)
    np.put_along_axis(a, top_at, rest_sum, -1)


def exact_second_into(p: np.ndarray, tau: np.ndarray, ell: np.ndarray, positive: np.ndarray | None,
                       out: np.ndarray, buf: Scratch) -> None:
    """``max(softmax_worst(p, tau) − p·ℓ, 0)`` into ``out`` (the exact rows of :func:`second_order`)."""
    shape = p.shape
    up, down = buf("sw_up", shape), buf("sw_down", shape)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        np.minimum(tau, 350.0, out=up)
        np.negative(up, out=down)
        np.exp(up, out=up)
        np.exp(down, out=down)
        for e, name in ((up, "sw_lo"), (down, "sw_hi")):
            t = buf(name, shape)
            np.multiply(p, e, out=t)
            others_inplace(t, buf)
            t *= e
            t += p
            np.divide(p, t, out=t)  # lo (up), hi (down)
        lo, hi = buf("sw_lo", shape), buf("sw_hi", shape)
        hi -= p
        np.subtract(p, lo, out=lo)
        np.maximum(hi, lo, out=out)
        np.fmin(out, 1.0, out=out)  # fmin: NaN (0/0, inf/inf) -> 1
        if positive is not None:
            np.copyto(out, 0.0, where=~positive)
        np.multiply(p, ell, out=lo)
        out -= lo
        np.maximum(out, 0.0, out=out)


class WeightsParts(NamedTuple):
    pp: np.ndarray  # p²
    q: np.ndarray  # p²·t_s²
    pk: np.ndarray  # Σ_S p²·t_s² (per row)
    p_round: np.ndarray  # the softmax's own rounding, worst-case
    second: np.ndarray  # the second-order term


def weights_into(p: np.ndarray, ts2: np.ndarray, abs_s: np.ndarray, visf: np.ndarray | None, u: float,
                  ua: float, a_s: Acc, floor: float, cap: bool, sig_out: np.ndarray, wor_out: np.ndarray,
                  buf: Scratch) -> WeightsParts:
    """Bound of the attention weights ``p`` whose scores have error variances ``ts2`` (any finite
    value where masked: p is 0 there): sigma and worst into ``sig_out`` and ``wor_out``, 0 where
    masked (``visf``: the visibility as 0/1, None when all visible).  ``cap``: the worst part is
    at most 1 (+ floor).  As the model's :func:`~mhaspec.conformance.model.forward.weights` and the
    local :func:`~mhaspec.conformance.model.local.weights`."""
    shape, u2 = p.shape, u * u
    pp, q = buf("w_pp", shape), buf("w_q", shape)
    np.multiply(p, p, out=pp)
    np.multiply(pp, ts2, out=q)
    pk = q.sum(axis=-1, keepdims=True)
    # sigma = p·sqrt((1 − p)² t² + max(pk − p² t², 0) + u² + U64² + σ_S²)  (:func:`weights_sigma`)
    t, d = buf("w_t", shape), buf("w_d", shape)
    np.subtract(1.0, p, out=t)
    np.multiply(t, t, out=t)
    t *= ts2
    np.subtract(pk, q, out=d)
    np.maximum(d, 0.0, out=d)
    t += d
    t += u2 + U64**2 + a_s.sigma**2
    np.sqrt(t, out=t)
    np.multiply(p, t, out=sig_out)
    # the softmax's own rounding, worst-case: p (γ_S + ua (|s| + max_visible |s|))
    p_round = buf("w_round", shape)
    np.add(abs_s, row_max_visible(abs_s, visf, buf), out=p_round)
    p_round *= ua
    p_round += a_s.worst
    p_round *= p
    # the second-order term, scores moving by up to LAMBDA·sqrt(t²)
    tau = buf("w_tau", shape)
    np.sqrt(ts2, out=tau)
    tau *= LAMBDA
    if visf is not None:
        tau *= visf
    positive = None if p.min() > 0 else np.greater(p, 0.0, out=buf("w_pos", shape, bool))
    second = buf("w_second", shape)
    second_order_into(p, tau, positive, second, buf)
    np.add(p_round, second, out=wor_out)
    if cap:
        np.minimum(wor_out, 1.0, out=wor_out)
    wor_out += floor
    if visf is not None:
        wor_out *= visf
    if a_s.sigma:  # all of the softmax's own rounding, for the head outputs
        p_round += a_s.sigma * p
    return WeightsParts(pp, q, pk, p_round, second)


def attention_chunk(c: AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: Pair, aK: Pair,
                          V: np.ndarray, V2: np.ndarray, aV: Pair, tV2: Pair, s: np.ndarray, p: np.ndarray,
                          o: np.ndarray, vis: np.ndarray, out: ChunkOut, buf: Scratch, seen_only: bool = False,
                          length: int | None = None) -> bool:
    """:func:`mhaspec.conformance.model.forward.attention_chunk`, in place (see above); False (nothing
    to trust in ``out``) where a value is not finite.  ``seen_only``: over the keys the chunk's rows see
    (:func:`~mhaspec.spec.masks.seen_keys`), every later key's bounds 0 (a masked weight's; masked scores are not
    compared), the float32 products' factor of the whole row's ``length``."""
    S = s.shape[-1]
    k = seen_keys(vis) if seen_only else S
    if k < S:
        for a in (*out.scores, *out.attn_weights):
            a[..., k:] = 0.0

        def seen(b: Any) -> Any:
            return type(b)(*(x[..., :k] for x in b))

        return attention_chunk(c, Q, tQ2, KK[..., :k], aK[..., :k], V[:, :k], V2[:, :k], aV[:, :k], tV2[:, :k],
                               s[..., :k], p[..., :k], o, vis[..., :k],
                               ChunkOut(seen(out.scores), seen(out.attn_weights), out.head_outputs), buf, length=S)
    u, u2 = c.u, c.u**2
    shape = s.shape
    (sig_s, wor_s), (sig_p, wor_p) = out.scores, out.attn_weights
    o2_out, wo_out = out.head_outputs.var, out.head_outputs.acc
    visf = None if vis.all() else vis.astype(np.float64)
    # 2. scores
    s2, ws = buf("a_s2", shape), buf("a_ws", shape)
    if not product32(query_operand(Q, tQ2, u2, buf), KK, c.scale**2 * u2, s2):
        return False
    t = buf("a_t", shape)
    np.multiply(s, s, out=t)
    t *= 2 * u2 + U64**2  # stored(u, s, s)
    s2 += t
    # the score sums' accumulation, m = scale·|Q||K|ᵀ: σ_d·m in sigma, γ_d·m in worst (one of them is 0)
    if not product32(np.abs(Q, out=buf("a_aQ", Q.shape, np.float32)), aK, c.scale, ws):
        return False
    ts2 = buf("a_ts2", shape)
    if c.a_d.sigma:
        np.multiply(ws, c.a_d.sigma, out=ts2)
        ts2 *= ts2
        s2 += ts2
    np.sqrt(s2, out=sig_s)
    ws *= c.a_d.worst
    np.add(ws, c.floor, out=wor_s)
    # 3. attention weights
    np.multiply(ws, ws, out=ts2)
    ts2 += s2
    abs_s = np.abs(s, out=t)
    w = weights_into(p, ts2, abs_s, visf, u, c.ua, c.a_s, c.floor, True, sig_p, wor_p, buf)
    # 4. head outputs (the model's head_outputs)
    lhs = buf("a_lhs", shape)
    np.multiply(w.pp, u2 + U64**2, out=lhs)
    np.add(w.q, lhs, out=lhs)
    np.multiply(w.p_round, w.p_round, out=t)
    lhs += t
    if c.a_s.sigma:  # P·V's accumulation as a standard deviation: σ_S²·Σ_j p_j v_j²
        np.multiply(p, c.a_s.sigma**2, out=t)
        lhs += t
    var_v2 = lhs @ V2
    o2 = (np.maximum(var_v2 - 2 * o * (w.q @ V) + o * o * w.pk, 0.0) + u2 * upper32(w.pp, tV2, length)
          + stored(u, o, o))
    np.multiply(p, c.a_s.worst, out=lhs)
    np.add(w.second, lhs, out=lhs)
    o2_out[...] = o2
    wo_out[...] = upper32(lhs, aV, length)
    return finite(sig_s, wor_s, sig_p, wor_p, o2_out, wo_out)


def local_scores(q: np.ndarray, K: np.ndarray, K2: Pair, aK: Pair, scale: float, u: float, a_d: Acc,
                       floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch,
                       vis: np.ndarray | None = None) -> bool:
    """The local scores check of one chunk (see :func:`local_references`) into ``out`` = (reference,
    sigma, worst); False where a value is not finite.  With the chunk's visibility ``vis``: over the keys
    its rows see (:func:`~mhaspec.spec.masks.seen_keys`; masked scores are not compared, later keys get 0)."""
    ref, sig, wor = out
    k = ref.shape[-1] if vis is None else seen_keys(vis)
    if k < ref.shape[-1]:
        for a in out:
            a[..., k:] = 0.0
        return local_scores(q, K[:, :k], K2[..., :k], aK[..., :k], scale, u, a_d, floor,
                            (ref[..., :k], sig[..., :k], wor[..., :k]), buf)
    np.matmul(q, swap(K), out=ref)
    ref *= scale
    if not product32(q * q, K2, 2 * scale**2 * u * u, sig):
        return False
    t = buf("ls_t", ref.shape)
    np.multiply(ref, ref, out=t)
    t *= 2 * u * u + U64**2  # stored(u, x, x)
    sig += t
    if not product32(np.abs(q), aK, scale, wor):
        return False
    if a_d.sigma:
        np.multiply(wor, a_d.sigma, out=t)
        t *= t
        sig += t
    np.sqrt(sig, out=sig)
    wor *= a_d.worst
    wor += floor
    return finite(sig)  # ref is (its square is in sig), wor is (product32 found its product finite)


def local_weights(s: np.ndarray, vis: np.ndarray, u: float, ua: float, a_s: Acc, floor: float,
                        out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch, seen_only: bool = False,
                        lse: Callable[..., None] | None = None) -> bool:
    """The local attention-weights check of one chunk from the adapter's own scores ``s``; ``seen_only``:
    over the keys the chunk's rows see (:func:`~mhaspec.spec.masks.seen_keys`), later keys a masked key's 0.
    ``lse``: the local lse check of the same chunk, which shares this one's work, called as ``lse(p, ts2,
    abs_s, vis, log_sum_exp, shared)`` (:func:`~mhaspec.conformance.model.variants.lse`'s operands over the keys
    seen, and the τ, Σ p²·T_s² and max|s| the weights' bound formed: :class:`~.model.variants.LseShared`)."""
    ref, sig, wor = out
    k = seen_keys(vis) if seen_only else s.shape[-1]
    if k < s.shape[-1]:
        for a in out:
            a[..., k:] = 0.0
        return local_weights(s[..., :k], vis[..., :k], u, ua, a_s, floor, (ref[..., :k], sig[..., :k], wor[..., :k]),
                             buf, lse=lse)
    if vis.all():
        if not finite(s):
            return False
        visf = None
        peak = s.max(axis=-1, keepdims=True)
        np.subtract(s, peak, out=ref)
        np.exp(ref, out=ref)
        total = ref.sum(axis=-1, keepdims=True)  # >= 1: the row's peak
        ref /= total
        log_sum_exp = None if lse is None else peak + np.log(total)
    else:
        clean, masked = buf("lw_s", s.shape), np.logical_not(vis, out=buf("lw_masked", s.shape, bool))
        np.copyto(clean, s)
        np.copyto(clean, 0.0, where=masked)  # masked scores (often -inf) take no part in the bounds
        if not finite(clean):
            return False
        log_sum_exp = visible_softmax_into(clean, masked, ref)
        s, visf = clean, vis.astype(np.float64)
    ts2, abs_s = buf("lw_ts2", s.shape), buf("lw_abs", s.shape)
    np.multiply(s, s, out=ts2)  # stored(u, s) = U64²·s² + u²·s², in its order (the lse's bit for bit)
    np.multiply(ts2, u**2, out=abs_s)
    ts2 *= U64**2
    ts2 += abs_s
    np.abs(s, out=abs_s)
    parts = weights_into(ref, ts2, abs_s, visf, u, ua, a_s, floor, False, sig, wor, buf)
    if lse is not None:  # τ: weights_into's (LAMBDA·T_s, 0 where masked); |s| is 0 where masked: its plain maximum
        lse(ref, ts2, abs_s, vis, log_sum_exp,
            LseShared(buf("w_tau", s.shape), parts.pk, abs_s.max(axis=-1, keepdims=True)))
    return finite(sig, wor)


def visible_softmax_into(s: np.ndarray, masked: np.ndarray, out: np.ndarray) -> np.ndarray:
    """:func:`~mhaspec.conformance.model.softmax.softmax_visible` of the finite ``s`` in place into ``out``
    (the same numbers: masked entries and blind rows 0), without its five full-size temporaries; returns
    the rows' :func:`~mhaspec.conformance.model.variants.log_sum_exp` (the same numbers: −inf for a blind row)."""
    np.copyto(out, s)
    np.copyto(out, -np.inf, where=masked)
    peak = out.max(axis=-1, keepdims=True)
    np.copyto(peak, 0.0, where=~np.isfinite(peak))  # a blind row: all -inf, exp 0
    out -= peak
    np.minimum(out, 0.0, out=out)
    np.exp(out, out=out)
    total = out.sum(axis=-1, keepdims=True)
    seen = total > 0  # a seen row has its peak's e^0 = 1
    with np.errstate(divide="ignore"):
        log_sum_exp = np.where(seen, peak + np.log(total), -np.inf)
    np.copyto(total, 1.0, where=~seen)  # a row of zeros stays 0
    out /= total
    return log_sum_exp


def local_outputs(pc: np.ndarray, V: np.ndarray, V2: Pair, aV: Pair, u: float, a_s: Acc,
                  floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch,
                  operands: tuple[np.ndarray, np.ndarray] | None = None, nonzero_only: bool = False,
                  length: int | None = None) -> bool:
    """The local head-outputs check of one chunk from the adapter's own weights ``pc``; ``operands``:
    the float32 operands p² and |p| of its bound products, already formed (and ``pc`` found finite)
    by the compiled loop (:func:`.compiled.local_outputs`), the same numbers.  ``nonzero_only`` (``V``
    finite): the products over the keys up to the last one with a nonzero weight in some row of the
    chunk (:func:`~mhaspec.spec.masks.seen_keys`: the later terms are 0), their factor of the whole row's ``length``."""
    ref, sig, wor = out
    S = pc.shape[-1]
    k = seen_keys(pc != 0) if nonzero_only else S
    if k < S:
        return local_outputs(pc[..., :k], V[:, :k], V2[:, :k], aV[:, :k], u, a_s, floor, out, buf,
                             None if operands is None else tuple(x[..., :k] for x in operands), length=S)
    if operands is not None:
        sq, ab = operands
    else:
        if not finite(pc):
            return False
        sq, ab = np.multiply(pc, pc, out=buf("lo_t", pc.shape)), None
    np.matmul(pc, V, out=ref)
    if not product32(sq, V2, 2 * u * u, sig, length):
        return False
    sig += stored(u, ref, ref)
    if not product32(np.abs(pc, out=sq) if ab is None else ab, aV, 1.0, wor, length):
        return False
    if a_s.sigma:
        t = np.multiply(wor, a_s.sigma, out=buf("lo_acc", wor.shape))
        t *= t
        sig += t
    np.sqrt(sig, out=sig)
    wor *= a_s.worst
    wor += floor
    return finite(sig)  # ref is (its square is in sig), wor is (product32 found its product finite)


def route_into(pc: np.ndarray, softmax: tuple[np.ndarray, np.ndarray, np.ndarray], out: np.ndarray,
               buf: Scratch) -> np.ndarray:
    """:func:`~mhaspec.conformance.model.local.weights_route` from the adapter's own softmax (reference,
    sigma, worst) of the chunk's weights ``pc``, into ``out`` without its temporaries: the same numbers,
    ``|pc − ref| + (LAMBDA·sigma + worst)``, NaN made +inf."""
    ref, sig, wor = softmax
    with np.errstate(invalid="ignore"):
        np.subtract(pc, ref, out=out)
        np.abs(out, out=out)
        t = np.multiply(sig, LAMBDA, out=buf("route_t", sig.shape))
        t += wor
        out += t
    return inf_for_nan(out)


def tolerance_into(sigma: np.ndarray, worst: np.ndarray, extra: Any, out: np.ndarray, buf: Scratch) -> None:
    """``out = LAMBDA·sigma + (worst + extra)`` (``extra``: a reference error), in place: the numbers
    of ``Bound(sigma, worst)`` widened by :func:`~mhaspec.conformance.judging.with_reference_error`,
    then :meth:`~mhaspec.conformance.model.vocabulary.Bound.tolerance`."""
    if isinstance(extra, float) and extra == 0.0:
        w = worst
    else:
        w = np.add(worst, extra, out=buf("tol_w", worst.shape))
    np.multiply(sigma, LAMBDA, out=out)
    out += w
