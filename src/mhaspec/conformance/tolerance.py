"""Element-wise tolerances, in float64: what a correct implementation may get wrong.

docs/tolerances.md derives every formula and constant here.  In short, each
stage's allowed error has two parts:

* ``sigma`` — the **rounding noise**: every intermediate result may be stored
  in the dtype under test (one or two roundings of relative size ≤ u each),
  and those roundings propagate, linearised, through the later stages.
  Independent roundings add in quadrature (root-sum-square), as in Higham &
  Mary's probabilistic rounding-error analysis, so the allowance is
  ``LAMBDA · sigma`` with ``sigma² = Σ (bound of each rounding)²``;
* ``worst`` — the **accumulation error**, bounded worst-case: a length-n sum
  in the accumulator (float32 for float16/bfloat16 runs — the precision
  contract; the dtype itself for float32/float64) is off by at most
  ``γ_acc(n)·Σ|aᵢbᵢ|`` in any order (Higham, *Accuracy and Stability*, §3.1),
  plus the second-order terms of the softmax.

``tolerance = LAMBDA · sigma + worst + floor``.  On top of the element-wise
test, :mod:`.compare` checks the *mean square* of ``error / sigma``: rounding
noise is zero-mean and its mean square is at most 1/3 of ``sigma²``, so a
systematic error (a dropped bias, a wrong scale that is small per element)
fails there even where no single element exceeds ``LAMBDA · sigma``.

Two precision contracts (``precision=``):

* ``"standard"`` (default) — the above: results stored in the dtype, sums
  accumulated in float32 or wider (float64 for float64 runs), softmax in
  float32.  This is what every production float16/bfloat16 kernel does.
* ``"worst-case"`` — anything a correct algorithm *in the dtype* could
  produce, accumulating in the dtype in any order: the classic worst-case
  bound γ_d(n + 4)·Σ|aᵢbᵢ| propagated through every stage.  Far wider in
  float16/bfloat16; stages it cannot resolve are reported *uninformative*.

Besides the golden (end-to-end) bounds, :func:`local_references` recomputes
each exposed stage in float64 from the adapter's *own* previous exposed
stage(s), with a bound of that stage's own rounding only: those checks are
as tight in bfloat16 as in float64 and put the first failing stage exactly
where the bug is.

Shapes (axis legend B, T, S, H, G = H_kv, D = D_k, E = D_v):
q (B,T,H·D), k (B,S,G·D), v (B,S,G·E), scores/attn (B,H,T,S),
heads (B,H,T,E), concat (B,T,H·E), output (B,T,d_out).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from ..fixtures import GoldenCase
from ..spec import REGISTRY, STAGES
from ..spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from .compare import Scratch

PRECISIONS = ("standard", "worst-case")

#: Per-element allowance in units of sigma.  Under the model each element's error is a sum of
#: independent zero-mean roundings with |term_i| <= b_i and sigma² = Σ b_i², so by Hoeffding's
#: inequality P(|error| > LAMBDA·sigma) <= 2·exp(-LAMBDA²/2) = 2.5e-14 for LAMBDA = 8
#: (docs/tolerances.md).
LAMBDA = 8.0

#: Limit on the mean of (error/sigma)² over a stage (standard contract).  A rounding error
#: uniform in [-b, b] has mean square b²/3, so correct code averages <= 1/3; KAPPA = 1 leaves 3x.
KAPPA = 1.0

#: The mean-square test needs this many compared elements (fewer: element-wise test only).
KAPPA_MIN_ELEMENTS = 16

#: Unit roundoff of the golden itself (float64): its own rounding enters every bound.
U64 = 2.0**-53


class Bound(NamedTuple):
    """Allowed error of every element: ``LAMBDA·sigma + worst + floor`` (see module docstring)."""

    sigma: np.ndarray  # rounding noise, root-sum-square (a standard-deviation bound)
    worst: np.ndarray  # worst-case part (accumulation, second order, floor)

    def tolerance(self, lam: float) -> np.ndarray:
        out = np.multiply(self.sigma, lam)
        if np.shape(out) == np.broadcast_shapes(np.shape(out), np.shape(self.worst)):
            out += self.worst  # one new array, not two (``lam * sigma + worst``): the same numbers
            return out
        return out + self.worst


def gamma(n: int | np.ndarray, u: float) -> np.ndarray:
    """γ(n) = n·u / (1 - n·u): the relative bound of a length-n sum (inf once n·u >= 1)."""
    if isinstance(n, (int, np.integer)):  # one length (most calls): the same value, without arrays
        nu = float(n) * u
        return np.float64(nu / (1 - nu) if nu < 1 else np.inf)  # type: ignore[return-value]
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.maximum(1 - nu, 0), np.inf)


def heads(x: np.ndarray, n_heads: int, group: int = 1) -> np.ndarray:
    """(B, L, n_heads·D) -> (B, n_heads·group, L, D), repeating each head ``group`` times (GQA)."""
    B, L, F = x.shape
    return np.repeat(x.reshape(B, L, n_heads, F // n_heads).transpose(0, 2, 1, 3), group, axis=1)


def merge(x: np.ndarray) -> np.ndarray:
    """(B, H, T, E) -> (B, T, H·E): heads concatenated in head order."""
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def _t(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def softmax_visible(s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """float64 softmax over S of the visible scores; masked entries and blind rows are 0."""
    x = np.where(visible, s, -np.inf)
    peak = np.max(x, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(visible, np.exp(np.minimum(x - peak, 0.0)), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)


class _Units(NamedTuple):
    u: float  # the dtype's unit roundoff: one rounding of a stored result
    acc: float  # the accumulator's: float32 for 16-bit dtypes under the standard contract


def _units(dtype: str, table: ToleranceTable) -> _Units:
    u = table.dtypes[dtype].unit_roundoff
    return _Units(u, min(u, table.dtypes["float32"].unit_roundoff))


# --- rounding noise of one stage ------------------------------------------------------------

def _stored(u: float, *values: np.ndarray) -> np.ndarray:
    """Variance bound of storing each of ``values`` in the dtype (one rounding each) plus the
    golden's own float64 rounding of the last one."""
    out = U64**2 * values[-1] ** 2
    for v in values:
        out = out + u**2 * v**2
    return out


def _softmax_rel2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Relative variance (Var/p_j²) of p_j from independent score errors with variances
    ``sigma2_s`` (linearised): δp_j = p_j (δs_j − Σ_k p_k δs_k), so
    Var = p_j² ((1 − p_j)² σ_j² + Σ_{k≠j} p_k² σ_k²).  Relative, because p_j² underflows
    for the tiny weights of large logits."""
    pk = np.sum(p**2 * sigma2_s, axis=-1, keepdims=True)
    return (1 - p) ** 2 * sigma2_s + np.maximum(pk - p**2 * sigma2_s, 0.0)


def _softmax_sigma2(p: np.ndarray, sigma2_s: np.ndarray) -> np.ndarray:
    """Variance of p_j (see :func:`_softmax_rel2`)."""
    return p**2 * _softmax_rel2(p, sigma2_s)


def _others(a: np.ndarray) -> np.ndarray:
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


def _softmax_worst(p: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Exact bound on |p'_j − p_j| when each visible score moves by at most t_j.

    p'_j = p_j / (p_j + R_j) with R_j = Σ_{k≠j} p_k e^{δ_k − δ_j}, so
    R_j ∈ [e^{−t_j} Σ_{k≠j} p_k e^{−t_k}, e^{t_j} Σ_{k≠j} p_k e^{t_k}]: a key that dominates
    its row (p_j ≈ 1) stays put whatever its own score does.
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        tt = np.minimum(t, 350.0)
        up, down = np.exp(tt), np.exp(-tt)
        others_up, others_down = _others(p * up), _others(p * down)
        lo = p / (p + up * others_up)
        hi = p / (p + down * others_down)
        err = np.maximum(hi - p, p - lo)
    return np.where(p > 0, np.fmin(err, 1.0), 0.0)  # fmin: NaN (0/0, inf/inf) -> 1


#: Rows whose score movement X_j (see :func:`_second_order`) stays at or below this take the
#: closed-form second-order bound, the others the exact pairwise one.  The closed form can be
#: about twice the exact second-order term, and that term, carried worst-case, adds up over the
#: keys in the head outputs; at this threshold it only applies where the term is negligible:
#: float32 and float64 runs (tolerances at most 0.5 % wider than the exact bound's on the catalog,
#: docs/tolerances.md), never the float16/bfloat16 ones.
SECOND_ORDER_CLOSED_FORM = 2.0**-10


def _second_order(p: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """What the linearisation misses when scores move by up to ``tau``: the exact bound
    (:func:`_softmax_worst`) less its first-order part p_j ℓ_j, ℓ_j = (1 − p_j) τ_j + Σ_{k≠j} p_k τ_k.

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
    exact = np.maximum(_softmax_worst(pe, te) - pe * ell[rows], 0.0)
    closed[rows] = exact
    return closed


#: Elements of the (B, H, T, S) stages handled at once by :func:`golden_bounds`: its
#: element-wise work then stays in the processor's cache (a whole stage of a large case does not).
CHUNK_ELEMENTS = 1 << 16


def _one_blas_thread() -> Any:
    """A context in which BLAS runs on one thread (threadpoolctl), for the chunk loops.

    Their products are small ((rows × D) @ (D × S)); a multi-threaded BLAS spends more on
    waking and syncing its threads than on the arithmetic, and on a busy machine (tox -p, a
    loaded CI runner) its spinning threads made the loop ten times slower (docs/tolerances.md)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency; only speed is lost without it
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


#: Threads of the chunk loops of a large case (at most; never more than the CPUs this process
#: may use).  NumPy and BLAS release the GIL in each operation, and the chunks write disjoint
#: slices, so the bounds do not depend on the number of threads.
MAX_THREADS = 4

#: A case with fewer chunks than this runs them on the calling thread.
THREADED_MIN_CHUNKS = 16


def _threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def _each_chunk(N: int, T: int, S: int, fn: Any, elements: int | None = None) -> None:
    """``fn(heads, rows, scratch)`` on every chunk (:func:`_chunks`, of about ``elements``, by default
    :data:`CHUNK_ELEMENTS`).  Many chunks: BLAS on one thread, the chunks shared among
    :func:`_threads` threads, each with its own work arrays."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    chunks = _chunks(N, T, S, elements)
    threads = _threads() if len(chunks) >= max(2, THREADED_MIN_CHUNKS * CHUNK_ELEMENTS // elements) else 1
    if threads == 1:
        scratch = Scratch()
        with _one_blas_thread() if len(chunks) > 8 else contextlib.nullcontext():
            for n, r in chunks:
                fn(n, r, scratch)
        return

    state = np.geterr()  # the caller's floating-point error handling: a thread does not inherit it

    def share(part: list[tuple[slice, slice]]) -> None:
        scratch = Scratch()
        with np.errstate(**state):
            for n, r in part:
                fn(n, r, scratch)

    step = -(-len(chunks) // threads)
    with _one_blas_thread(), ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(share, chunks[i:i + step]) for i in range(0, len(chunks), step)]:
            future.result()


def _chunks(N: int, T: int, S: int, elements: int | None = None) -> list[tuple[slice, slice]]:
    """(head slice, query-row slice) of each chunk of a (N, T, S) array, N = B·H, of about
    ``elements`` (by default :data:`CHUNK_ELEMENTS`)."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    if T * S <= elements:
        step = max(1, elements // max(T * S, 1))
        return [(slice(n, min(N, n + step)), slice(None)) for n in range(0, N, step)]
    rows = max(1, elements // max(S, 1))
    return [(slice(n, n + 1), slice(t, min(T, t + rows))) for n in range(N) for t in range(0, T, rows)]


# --- golden (end-to-end) bounds ---------------------------------------------------------------

class _AttentionConstants(NamedTuple):
    u: float  # the dtype's unit roundoff
    ua: float  # the accumulator's
    scale: float
    g_d: float  # γ_acc(D_k + k): the score sums
    g_s: float  # γ_acc(S + k): the softmax and P·V sums
    floor: float  # the dtype's absolute floor


#: Unit roundoff of float32, in which the bounds' own non-negative sums are formed (below).
_U32 = 2.0**-24


class _Pair(NamedTuple):
    """A right-hand operand of :func:`_upper32` in float64 and, cast once, in float32."""

    f64: np.ndarray
    f32: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray) -> "_Pair":
        return cls(x, x.astype(np.float32))

    def __getitem__(self, index: Any) -> "_Pair":  # type: ignore[override]
        return _Pair(self.f64[index], self.f32[index])


def _upper32(a: np.ndarray, b: "_Pair") -> np.ndarray:
    """``a @ b`` for non-negative ``a`` and ``b``, formed in float32 and rounded up.

    A sum of n non-negative terms in float32 is below the exact one by at most γ₃₂(n + 2)
    relative (two more roundings: the inputs'); multiplying by 1 + 2γ₃₂ keeps it an upper
    bound, at half the cost of a float64 product.  Callers scale ``a`` and ``b`` to O(1)
    magnitudes so that nothing that matters underflows."""
    n = a.shape[-1] + 2
    with np.errstate(over="ignore", invalid="ignore"):
        out = (a.astype(np.float32) @ b.f32).astype(np.float64)
    if not np.isfinite(out).all():  # beyond float32's range (an adapter's own wild values)
        return a @ b.f64
    return out * (1 + 2 * gamma(n, _U32))


def _inf_for_nan(x: np.ndarray) -> np.ndarray:
    np.copyto(x, np.inf, where=np.isnan(x))
    return x


def _attention_chunk(c: _AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: _Pair,
                     aK: _Pair, V: np.ndarray, V2: np.ndarray, aV: _Pair, tV2: _Pair,
                     s: np.ndarray, p: np.ndarray, o: np.ndarray, vis: np.ndarray,
                     out: tuple[np.ndarray, ...]) -> None:
    """Bounds of scores, attention weights and head outputs for one chunk of query rows.

    ``KK`` = [K², t_K²/u²]ᵀ and ``aK`` = |K|ᵀ; ``V2`` = V², ``aV`` = |V|, ``tV2`` = t_V²/u² (the
    variances scaled by 1/u² so that the float32 products of :func:`_upper32` cannot underflow).
    Writes (sigma, worst) of the scores and the attention weights, and (variance, worst) of the
    head outputs into ``out``.
    """
    u, ua, u2 = c.u, c.ua, c.u**2
    # 2. scores = scale · Q Kᵀ: δs = scale Σ_d (δQ_d K_d + Q_d δK_d).
    s2 = (c.scale**2 * u2) * _upper32(np.concatenate([tQ2 / u2, Q * Q], axis=-1), KK) + _stored(u, s, s)
    ws = (c.g_d * c.scale) * _upper32(np.abs(Q), aK)
    # 3. attention weights: linearised propagation of the score errors, the storage rounding of
    #    P; worst-case: the float32 softmax's own rounding and the second-order term of exp.
    ts2 = np.where(vis, s2 + ws * ws, 0.0)
    pp = p * p
    p_sigma = np.where(vis, _inf_for_nan(p * np.sqrt(_softmax_rel2(p, ts2) + u2 + U64**2)), 0.0)
    row_max = np.max(np.where(vis, np.abs(s), 0.0), axis=-1, keepdims=True)
    p_round = p * (c.g_s + ua * (np.abs(s) + row_max))  # the softmax's own rounding
    second = np.where(vis, _second_order(p, np.where(vis, LAMBDA * np.sqrt(ts2), 0.0)), 0.0)
    wp = np.where(vis, _inf_for_nan(np.minimum(p_round + second, 1.0)) + c.floor, 0.0)
    # 4. head outputs o = P V: score errors move o by Σ_j p_j δs_j (v_j − o) (the weights sum to
    #    1), whose variance Σ_j q_j (v_j − o)², q = p² t_s², is expanded into products (in
    #    float64: it cancels); P's own storage rounding and softmax rounding add Σ_j c_j v_j², with
    #    c = (u² + U64²) p² + p_round², folded into the same product; V's by Σ_j p_j² t_{V,j}².
    #    The second-order part of P is carried worst-case.
    q_ = pp * ts2
    var_v2 = (q_ + (u2 + U64**2) * pp + p_round * p_round) @ V2
    o2 = (np.maximum(var_v2 - 2 * o * (q_ @ V) + o * o * np.sum(q_, axis=-1, keepdims=True), 0.0)
          + u2 * _upper32(pp, tV2) + _stored(u, o, o))
    wo = _upper32(second + c.g_s * p, aV)
    sig_s = _inf_for_nan(np.sqrt(np.maximum(s2, 0.0)))
    for dst, src in zip(out, (sig_s, _inf_for_nan(ws + c.floor), p_sigma, wp, o2, wo)):
        dst[...] = src


# --- the fast path of the chunk loops: the same formulas, in place, without np.where ----------
#
# The functions below compute exactly what :func:`_attention_chunk` and the local checks'
# chunk functions compute (tests/test_tolerance_model.py compares them), but in place on work
# arrays reused from chunk to chunk, and without ``np.where`` on chunks that need no mask:
# ``np.where`` costs about ten in-place passes, a fresh array a page fault per 4 KiB.  Masked
# entries need no mask where the formula multiplies by the attention weight, which is 0
# there.  A chunk where anything is not finite (an adapter's own wild values) is left to the
# general functions, which handle every special value; the fast functions then return False.


def _finite(*arrays: np.ndarray) -> bool:
    """Every value finite: one reduction each, the sum, which is NaN or ±inf when a value is.  A sum
    of finite values that overflows says False too, and such a chunk takes the general path (the
    same bounds, only slower)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return all(a.size == 0 or np.isfinite(a.sum()) for a in arrays)


def _product32(a: np.ndarray, b: _Pair, factor: float, out: np.ndarray) -> bool:
    """``out = factor · _upper32(a, b)`` (float64), False when the float32 product is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        m = a.astype(np.float32, copy=False) @ b.f32
    if not np.isfinite(m.max()):
        return False
    np.multiply(m, factor * (1 + 2 * float(gamma(a.shape[-1] + 2, _U32))), out=out, dtype=np.float64)
    return True


def _row_max_visible(x: np.ndarray, visf: np.ndarray | None, buf: Scratch) -> np.ndarray:
    """max over the visible entries of each row of the non-negative ``x`` (0 where none)."""
    if visf is None:
        return x.max(axis=-1, keepdims=True)
    t = buf("rowmax", x.shape)
    np.multiply(x, visf, out=t)
    return t.max(axis=-1, keepdims=True)


def _second_order_into(p: np.ndarray, tau: np.ndarray, positive: np.ndarray | None, out: np.ndarray,
                       buf: Scratch) -> None:
    """:func:`_second_order` (``p``, ``tau`` finite, non-negative) into ``out``; ``positive``:
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
            _exact_second_into(p, tau, ell, positive, out, buf)
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
        _exact_second_into(p, tau, ell, positive, out, buf)
        return
    rows = np.nonzero(exact_rows)
    sub = np.empty(p[rows].shape)
    _exact_second_into(p[rows], tau[rows], ell[rows], None if positive is None else positive[rows], sub,
                       Scratch())
    out[rows] = sub


def _exact_second_into(p: np.ndarray, tau: np.ndarray, ell: np.ndarray, positive: np.ndarray | None,
                       out: np.ndarray, buf: Scratch) -> None:
    """``max(_softmax_worst(p, tau) − p·ℓ, 0)`` into ``out`` (the exact rows of :func:`_second_order`)."""
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
            t[...] = _others(t)
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


class _WeightsParts(NamedTuple):
    pp: np.ndarray  # p²
    q: np.ndarray  # p²·t_s²
    pk: np.ndarray  # Σ_S p²·t_s² (per row)
    p_round: np.ndarray  # the softmax's own rounding, worst-case
    second: np.ndarray  # the second-order term


def _weights_into(p: np.ndarray, ts2: np.ndarray, abs_s: np.ndarray, visf: np.ndarray | None, u: float,
                  ua: float, g_s: float, floor: float, cap: bool, sig_out: np.ndarray, wor_out: np.ndarray,
                  buf: Scratch) -> _WeightsParts:
    """Bound of the attention weights ``p`` whose scores have error variances ``ts2`` (any finite
    value where masked: p is 0 there): sigma and worst into ``sig_out`` and ``wor_out``, 0 where
    masked (``visf``: the visibility as 0/1, None when all visible).  ``cap``: the worst part is
    at most 1 (+ floor).  As :func:`_attention_chunk` step 3 and the local weights check."""
    shape, u2 = p.shape, u * u
    pp, q = buf("w_pp", shape), buf("w_q", shape)
    np.multiply(p, p, out=pp)
    np.multiply(pp, ts2, out=q)
    pk = q.sum(axis=-1, keepdims=True)
    # sigma = p·sqrt((1 − p)² t² + max(pk − p² t², 0) + u² + U64²)  (:func:`_softmax_rel2`)
    t, d = buf("w_t", shape), buf("w_d", shape)
    np.subtract(1.0, p, out=t)
    np.multiply(t, t, out=t)
    t *= ts2
    np.subtract(pk, q, out=d)
    np.maximum(d, 0.0, out=d)
    t += d
    t += u2
    t += U64**2
    np.sqrt(t, out=t)
    np.multiply(p, t, out=sig_out)
    # the softmax's own rounding: p (g_s + ua (|s| + max_visible |s|))
    p_round = buf("w_round", shape)
    np.add(abs_s, _row_max_visible(abs_s, visf, buf), out=p_round)
    p_round *= ua
    p_round += g_s
    p_round *= p
    # the second-order term, scores moving by up to LAMBDA·sqrt(t²)
    tau = buf("w_tau", shape)
    np.sqrt(ts2, out=tau)
    tau *= LAMBDA
    if visf is not None:
        tau *= visf
    positive = None if p.min() > 0 else np.greater(p, 0.0, out=buf("w_pos", shape, bool))
    second = buf("w_second", shape)
    _second_order_into(p, tau, positive, second, buf)
    np.add(p_round, second, out=wor_out)
    if cap:
        np.minimum(wor_out, 1.0, out=wor_out)
    wor_out += floor
    if visf is not None:
        wor_out *= visf
    return _WeightsParts(pp, q, pk, p_round, second)


def _attention_chunk_fast(c: _AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: _Pair, aK: _Pair,
                          V: np.ndarray, V2: np.ndarray, aV: _Pair, tV2: _Pair, s: np.ndarray, p: np.ndarray,
                          o: np.ndarray, vis: np.ndarray, out: tuple[np.ndarray, ...], buf: Scratch) -> bool:
    """:func:`_attention_chunk`, in place (see above); False (nothing to trust in ``out``) where a
    value is not finite."""
    u, u2 = c.u, c.u**2
    shape = s.shape
    sig_s, wor_s, sig_p, wor_p, o2_out, wo_out = out
    visf = None if vis.all() else vis.astype(np.float64)
    # 2. scores
    s2, ws = buf("a_s2", shape), buf("a_ws", shape)
    if not _product32(np.concatenate([tQ2 / u2, Q * Q], axis=-1), KK, c.scale**2 * u2, s2):
        return False
    t = buf("a_t", shape)
    np.multiply(s, s, out=t)
    t *= 2 * u2 + U64**2  # _stored(u, s, s)
    s2 += t
    np.sqrt(s2, out=sig_s)
    if not _product32(np.abs(Q), aK, c.g_d * c.scale, ws):
        return False
    np.add(ws, c.floor, out=wor_s)
    # 3. attention weights
    ts2 = buf("a_ts2", shape)
    np.multiply(ws, ws, out=ts2)
    ts2 += s2
    abs_s = np.abs(s, out=t)
    w = _weights_into(p, ts2, abs_s, visf, u, c.ua, c.g_s, c.floor, True, sig_p, wor_p, buf)
    # 4. head outputs (see _attention_chunk)
    lhs = buf("a_lhs", shape)
    np.multiply(w.pp, u2 + U64**2, out=lhs)
    np.add(w.q, lhs, out=lhs)
    np.multiply(w.p_round, w.p_round, out=t)
    lhs += t
    var_v2 = lhs @ V2
    o2 = (np.maximum(var_v2 - 2 * o * (w.q @ V) + o * o * w.pk, 0.0) + u2 * _upper32(w.pp, tV2) + _stored(u, o, o))
    np.multiply(p, c.g_s, out=lhs)
    np.add(w.second, lhs, out=lhs)
    o2_out[...] = o2
    wo_out[...] = _upper32(lhs, aV)
    return _finite(sig_s, wor_s, sig_p, wor_p, o2_out, wo_out)


def _local_scores_fast(q: np.ndarray, K: np.ndarray, K2: _Pair, aK: _Pair, scale: float, u: float, g_d: float,
                       floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch) -> bool:
    """The local scores check of one chunk (see :func:`local_references`) into ``out`` = (reference,
    sigma, worst); False where a value is not finite."""
    ref, sig, wor = out
    np.matmul(q, _t(K), out=ref)
    ref *= scale
    if not _product32(q * q, K2, 2 * scale**2 * u * u, sig):
        return False
    t = buf("ls_t", ref.shape)
    np.multiply(ref, ref, out=t)
    t *= 2 * u * u + U64**2  # _stored(u, x, x)
    sig += t
    np.sqrt(sig, out=sig)
    if not _product32(np.abs(q), aK, g_d * scale, wor):
        return False
    wor += floor
    return _finite(ref, sig, wor)


def _local_weights_fast(s: np.ndarray, vis: np.ndarray, u: float, ua: float, g_s: float, floor: float,
                        out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch) -> bool:
    """The local attention-weights check of one chunk from the adapter's own scores ``s``."""
    ref, sig, wor = out
    if vis.all():
        if not _finite(s):
            return False
        visf = None
        np.subtract(s, s.max(axis=-1, keepdims=True), out=ref)
        np.exp(ref, out=ref)
        ref /= ref.sum(axis=-1, keepdims=True)  # >= 1: the row's peak
    else:
        ref[...] = softmax_visible(s, vis)
        clean = buf("lw_s", s.shape)
        np.copyto(clean, s)
        np.copyto(clean, 0.0, where=~vis)  # masked scores (often -inf) take no part in the bounds
        if not _finite(clean):
            return False
        s, visf = clean, vis.astype(np.float64)
    ts2, abs_s = buf("lw_ts2", s.shape), buf("lw_abs", s.shape)
    np.multiply(s, s, out=ts2)
    ts2 *= U64**2 + u * u  # _stored(u, s)
    np.abs(s, out=abs_s)
    _weights_into(ref, ts2, abs_s, visf, u, ua, g_s, floor, False, sig, wor, buf)
    return _finite(sig, wor)


def _local_outputs_fast(pc: np.ndarray, V: np.ndarray, V2: _Pair, aV: _Pair, u: float, g_s: float,
                        floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch,
                        kernels: Any = None) -> bool:
    """The local head-outputs check of one chunk from the adapter's own weights ``pc``; with
    ``kernels`` (:mod:`._kernels`), the float32 operands p² and |p| of its bound products are formed in
    one compiled sweep (:func:`._kernels.local_outputs_operands`), the same numbers."""
    ref, sig, wor = out
    if kernels is not None:
        sq, ab = buf("k_lo_pp", pc.shape, np.float32), buf("k_lo_ap", pc.shape, np.float32)
        if not _compiled(kernels, "local_outputs_operands", pc, sq, ab):
            return False
    else:
        if not _finite(pc):
            return False
        sq, ab = np.multiply(pc, pc, out=buf("lo_t", pc.shape)), None
    np.matmul(pc, V, out=ref)
    if not _product32(sq, V2, 2 * u * u, sig):
        return False
    sig += _stored(u, ref, ref)
    np.sqrt(sig, out=sig)
    if not _product32(np.abs(pc, out=sq) if ab is None else ab, aV, g_s, wor):
        return False
    wor += floor
    return _finite(ref, sig, wor)


def _local_scores_compiled(kernels: Any, q: np.ndarray, K: np.ndarray, K2: _Pair, aK: _Pair, scale: float,
                           u: float, g_d: float, floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray],
                           buf: Scratch) -> bool:
    """:func:`_local_scores_fast` with its elementwise passes in one compiled sweep
    (:func:`._kernels.local_scores_chunk`); the products stay in BLAS."""
    ref, sig, wor = out
    np.matmul(q, _t(K), out=ref)
    m_sig, m_wor = buf("k_ls_sig", ref.shape, np.float32), buf("k_ls_wor", ref.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul((q * q).astype(np.float32), K2.f32, out=m_sig)
        np.matmul(np.abs(q).astype(np.float32), aK.f32, out=m_wor)
    f32 = 1 + 2 * float(gamma(q.shape[-1] + 2, _U32))  # _product32's factor
    return _compiled(kernels, "local_scores_chunk", ref, m_sig, m_wor, scale, 2 * scale**2 * u * u * f32,
                     2 * u * u + U64**2, g_d * scale * f32, floor, sig, wor)


#: A case with more elements than this per (B, H, T, S) stage (8·1448², 2^24; the whole case's,
#: also where it is judged in smaller blocks) takes the compiled chunk loop when numba is installed
#: (:func:`_kernels_for`): numba compiles it once per process (about 3 s), which a run of the four
#: dtypes wins back from about this size on (docs/tolerances.md).  The committed catalog's cases
#: (at most 2^15) never do.
COMPILED_MIN_ELEMENTS = 1 << 24

#: Elements of a chunk of the compiled loop: it sweeps each row a few times in the L1 cache
#: whatever the chunk's size, and larger chunks make larger, faster products (2^16: 1.10 s,
#: 2^18: 0.86 s for the golden tolerances at T = S = 2048, docs/tolerances.md).
COMPILED_CHUNK_ELEMENTS = 1 << 18

#: ``MHASPEC_NUMBA=off`` (or ``0``, ``no``, ``false``): the NumPy chunk loops even where numba is installed.
NUMBA_ENV = "MHASPEC_NUMBA"


#: The first compilation error of the compiled loops in this process (they are not tried again).
_COMPILE_FAILED: list[str] = []
_COMPILE_LOCK = threading.Lock()


def _kernels_for(golden: GoldenCase) -> Any:
    """:func:`_kernels` for ``golden``, sized by the whole case where it is one block of query rows
    (:mod:`.blocks`): what pays back the compilation is the whole case's work, and a large case is
    judged in blocks smaller than :data:`COMPILED_MIN_ELEMENTS`."""
    B, H, T, S = golden.whole_shape or golden.visible.shape
    return _kernels(B * H, T, S)


def _kernels(N: int, T: int, S: int) -> Any:
    """The compiled chunk loops (:mod:`._kernels`) for a (N, T, S) case, or None: a small case, numba
    not installed (the ``fast`` extra), switched off by :data:`NUMBA_ENV`, or failed to compile."""
    if N * T * S <= COMPILED_MIN_ELEMENTS or _COMPILE_FAILED:
        return None
    if os.environ.get(NUMBA_ENV, "").strip().lower() in {"0", "off", "no", "false", "none"}:
        return None
    try:
        from . import _kernels as compiled
    except ImportError:  # numba absent (or unusable with this NumPy): the NumPy loops, same bounds
        return None
    return compiled


_DUMMY = np.empty((1, 1, 1))


def _compiled(kernels: Any, name: str, *args: Any) -> bool:
    """``kernels.name(*args)``; False (the caller takes the NumPy loop) where numba cannot compile it,
    which then warns once and switches the compiled loops off for the rest of the process."""
    if _COMPILE_FAILED:  # an earlier chunk's: numba would try (and fail) to compile it again
        return False
    try:
        return bool(getattr(kernels, name)(*args))
    except kernels.ERRORS as exc:
        with _COMPILE_LOCK:
            if not _COMPILE_FAILED:
                _COMPILE_FAILED.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")
                warnings.warn(f"mhaspec: numba could not compile the tolerance loop ({_COMPILE_FAILED[0]}); "
                              f"the NumPy loops are used instead (the same verdicts, slower)", RuntimeWarning,
                              stacklevel=2)
        return False


def _attention_chunk_compiled(kernels: Any, c: _AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: _Pair,
                              aK: _Pair, V: np.ndarray, V2: np.ndarray, aV: _Pair, tV2: _Pair, s: np.ndarray,
                              p: np.ndarray, o: np.ndarray, vis: np.ndarray, *,
                              bounds: tuple[np.ndarray, ...] | None, tolerances: tuple[np.ndarray, ...] | None,
                              extras: tuple[Any, Any], out: tuple[np.ndarray, np.ndarray], buf: Scratch) -> bool:
    """:func:`_attention_chunk_fast` by the compiled loop (:mod:`._kernels`): the bounds of the scores and
    the attention weights into ``bounds`` (sigma and worst of each) and/or their tolerances with the
    reference error ``extras`` into ``tolerances`` (``_tolerance_into``), (variance, worst) of the head
    outputs into ``out``; False (nothing to trust) where a value is not finite."""
    u2 = c.u**2
    shape = s.shape
    S = shape[-1]
    lhs_in = np.concatenate([tQ2 / u2, Q * Q], axis=-1)
    m1, m2 = buf("k_m1", shape, np.float32), buf("k_m2", shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul(lhs_in.astype(np.float32), KK.f32, out=m1)  # the products of :func:`_upper32`, factors in c1, c2
        np.matmul(np.abs(Q).astype(np.float32), aK.f32, out=m2)
    c1 = c.scale**2 * u2 * (1 + 2 * float(gamma(lhs_in.shape[-1] + 2, _U32)))
    c2 = c.g_d * c.scale * (1 + 2 * float(gamma(Q.shape[-1] + 2, _U32)))
    lhs, q, pk = buf("k_lhs", shape), buf("k_q", shape), buf("k_pk", shape[:-1])
    pp32, lhs32 = buf("k_pp32", shape, np.float32), buf("k_lhs32", shape, np.float32)
    # the reference errors: both arrays, or both values (the two arrays of a float64 golden are 0)
    arrays = not all(isinstance(e, float) for e in extras)
    ext: list[Any] = [arrays]
    for e in extras:
        ext += ([np.broadcast_to(e, shape), 0.0] if arrays else [_DUMMY, float(e)])
    with np.errstate(over="ignore", invalid="ignore"):
        ok = _compiled(
            kernels, "attention_chunk", s, p, vis, m1, m2, c1, c2, u2, c.ua, c.g_s, c.floor, 1.0,
            bounds is not None, *(bounds or (_DUMMY,) * 4), tolerances is not None,
            *(ext if tolerances is not None else (False,) + (_DUMMY, 0.0) * 2), *(tolerances or (_DUMMY,) * 2),
            lhs, q, pp32, lhs32, pk, buf("k_rows", (10, S)))
        if not ok:
            return False
        # 4. head outputs, as :func:`_attention_chunk_fast`
        f32 = 1 + 2 * float(gamma(S + 2, _U32))
        o2 = (np.maximum(lhs @ V2 - 2 * o * (q @ V) + o * o * pk[..., None], 0.0)
              + (u2 * f32) * (pp32 @ tV2.f32) + _stored(c.u, o, o))
        wo = lhs32 @ aV.f32
        if not _finite(o2, wo):
            return False
    out[0][...] = o2
    np.multiply(wo, f32, out=out[1], dtype=np.float64)
    return True


def golden_bounds(golden: GoldenCase, dtype: str, precision: str = "standard",
                  table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, Bound]:
    """The allowed error of every element of every stage of ``golden`` in ``dtype``."""
    return _golden(golden, dtype, precision, table, bounds=True, tolerances=False)[0]


def judging_bounds(golden: GoldenCase, dtype: str, precision: str = "standard",
                   table: ToleranceTable = DEFAULT_TOLERANCES) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """(:func:`golden_bounds`, the tolerance of every stage of the golden with its own error).

    The tolerances are those of ``golden.with_reference_error(bounds)`` (``LAMBDA·sigma +
    (worst + reference error)``, the same numbers); those of the (B, H, T, S) stages are
    formed chunk by chunk with their bounds, while they are in the processor's cache."""
    return _golden(golden, dtype, precision, table, bounds=True, tolerances=True, reference_error=True)


def _golden(golden: GoldenCase, dtype: str, precision: str, table: ToleranceTable, *, bounds: bool,
            tolerances: bool, reference_error: bool = False) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """(bounds, tolerances) of the golden stages, each only where asked (otherwise {}).  The
    tolerances are ``LAMBDA·sigma + worst``, with the golden's reference error in ``worst``
    where ``reference_error``; without ``bounds``, the bounds of the (B, H, T, S) stages are not
    kept."""
    def tolerances_of(raw: Mapping[str, Bound]) -> dict[str, np.ndarray]:
        widened = golden.with_reference_error(raw) if reference_error else raw
        return {name: b.tolerance(LAMBDA) for name, b in widened.items()}

    if precision == "worst-case":
        tol = worst_case_tolerances(golden, dtype, table)
        raw = {k: Bound(np.zeros_like(v), v) for k, v in tol.items()}
        return raw, (tolerances_of(raw) if tolerances else {})
    if precision != "standard":
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    un = _units(dtype, table)
    u, ua, k = un.u, un.acc, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    vis = golden.visible
    inp = golden.inputs

    # Each stage: ``var`` — the variance bound of everything that reached it from earlier stages
    # (their storage roundings and their accumulation errors, propagated linearised) plus its
    # own storage roundings; ``own`` — its own accumulation error, worst-case, which is not
    # averaged within the element but enters later stages as one more independent term.

    # 1. projections y = x @ W + b: inputs and weights are exact; the product and the bias add
    #    may each be rounded to the dtype; the sum is accumulated in the accumulator.
    def projection(x: np.ndarray, wn: str, bn: str, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = w.get(bn)
        xw = y if b is None else y - b
        mag = np.abs(x) @ np.abs(w[wn]) + (0.0 if b is None else np.abs(b))
        return _stored(u, xw, y), gamma(w[wn].shape[0] + k, ua) * mag

    q2, wq = projection(inp["query"], "w_q", "b_q", g["q_proj"])

    # 2.–4. the (B, H, T, S) stages, one chunk of heads × query rows at a time (see
    #    :func:`_attention_chunk`); every formula is element-wise or per row, so chunking
    #    changes nothing but the order of float64 roundings in the bounds themselves.
    s, p, o = g["scores"], g["attn_weights"], g["head_outputs"]
    B, _, T, S = s.shape
    E = o.shape[-1]
    N = B * H
    u2 = u**2

    def key_side() -> tuple[Any, ...]:
        """The keys' and values' bounds and the operands made of them (shared by the blocks of
        query rows of one batch entry: :meth:`GoldenCase.memoised`)."""
        k2, wk = projection(inp["key"], "w_k", "b_k", g["k_proj"])
        v2, wv = projection(inp["value"], "w_v", "b_v", g["v_proj"])
        K = heads(g["k_proj"], G, group).reshape(N, S, -1)
        tK2 = heads(k2 + wk**2, G, group).reshape(N, S, -1)
        V = heads(g["v_proj"], G, group).reshape(N, S, E)
        tV2 = heads(v2 + wv**2, G, group).reshape(N, S, E)
        KK = _Pair.of(_t(np.concatenate([K * K, tK2 / u2], axis=-1)))  # see _attention_chunk
        return k2, wk, v2, wv, KK, _Pair.of(_t(np.abs(K))), V, V * V, _Pair.of(np.abs(V)), _Pair.of(tV2 / u2)

    k2, wk, v2, wv, KK, aK, V, V2, aV, tV2 = golden.memoised(("golden key side", dtype, u, ua, k), key_side)
    Q = heads(g["q_proj"], H).reshape(N, T, -1)
    tQ2 = heads(q2 + wq**2, H).reshape(N, T, -1)
    sN, pN, oN, visN = (x.reshape(N, T, -1) for x in (s, p, o, golden.visible))
    floor = table.dtypes[dtype].floor
    # None: the chunks' bounds go to work arrays only
    sig_s, wor_s, sig_p, wor_p = [np.empty((N, T, S)) if bounds else None for _ in range(4)]
    o2, wo = np.empty((N, T, E)), np.empty((N, T, E))
    tol_s, tol_p = (np.empty((N, T, S)), np.empty((N, T, S))) if tolerances else (None, None)
    error = golden.reference_error if reference_error else None
    extra_s, extra_p = ((0.0, 0.0) if error is None else
                        (np.broadcast_to(e, (B, H, T, S)).reshape(N, T, S) if isinstance(e, np.ndarray) else e
                         for e in (error["scores"], error["attn_weights"])))
    cst = _AttentionConstants(u=u, ua=ua, scale=scale, g_d=float(gamma(cfg.D_k + k, ua)),
                              g_s=float(gamma(S + k, ua)), floor=floor)

    compiled = _kernels_for(golden)

    def chunk(n: slice, r: slice, buf: Scratch) -> None:
        args = (cst, Q[n, r], tQ2[n, r], KK[n], aK[n], V[n], V2[n], aV[n], tV2[n], sN[n, r], pN[n, r], oN[n, r],
                visN[n, r])
        if compiled is not None and _attention_chunk_compiled(
                compiled, *args, bounds=None if sig_s is None else tuple(a[n, r] for a in (sig_s, wor_s, sig_p, wor_p)),
                tolerances=None if tol_s is None else (tol_s[n, r], tol_p[n, r]),
                extras=tuple(e if isinstance(e, float) else e[n, r] for e in (extra_s, extra_p)),
                out=(o2[n, r], wo[n, r]), buf=buf):
            return
        shape = sN[n, r].shape
        out = tuple(buf(f"g_out{i}", shape) if a is None else a[n, r]
                    for i, a in enumerate((sig_s, wor_s, sig_p, wor_p))) + (o2[n, r], wo[n, r])
        if not _attention_chunk_fast(*args, out=out, buf=buf):
            _attention_chunk(*args, out=out)
        if tol_s is not None and tol_p is not None:
            for sig, wor, e, dst in ((out[0], out[1], extra_s, tol_s[n, r]), (out[2], out[3], extra_p, tol_p[n, r])):
                _tolerance_into(sig, wor, e if isinstance(e, float) else e[n, r], dst, buf)

    # the general path's arithmetic on an adapter's own NaN and inf (a deviation bound, a local
    # check) is deliberate: no RuntimeWarning, as in local_references (the chunks' threads inherit it)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        _each_chunk(N, T, S, chunk, CHUNK_ELEMENTS if compiled is None else COMPILED_CHUNK_ELEMENTS)
    o2, wo = o2.reshape(B, H, T, E), wo.reshape(B, H, T, E)

    # 5. concat relabels the heads; output = concat @ W_o + b_o.
    sc2, wc = merge(o2), merge(wo)
    c, y, wo_mat, bo = g["concat"], g["output"], w["w_o"], w.get("b_o")
    cw = y if bo is None else y - bo
    y2 = (sc2 + wc**2) @ wo_mat**2 + _stored(u, cw, y)
    aW = np.abs(wo_mat)
    wy = gamma(wo_mat.shape[0] + k, ua) * (np.abs(c) @ aW + (0.0 if bo is None else np.abs(bo)))

    raw = {
        "q_proj": (q2, wq), "k_proj": (k2, wk), "v_proj": (v2, wv),
        "head_outputs": (o2, wo), "concat": (sc2, wc), "output": (y2, wy),
    }
    out = {name: Bound(_inf_for_nan(np.sqrt(np.maximum(var, 0.0))), _inf_for_nan(worst + floor))
           for name, (var, worst) in raw.items()}
    order = STAGES
    tols: dict[str, np.ndarray] = {}
    if tolerances:
        tols = tolerances_of(out)
        assert tol_s is not None and tol_p is not None
        tols["scores"], tols["attn_weights"] = tol_s.reshape(B, H, T, S), tol_p.reshape(B, H, T, S)
        tols = {name: tols[name] for name in order}
    if not bounds:
        return {}, tols
    # masked attention weights must be exactly 0: no allowance at all (the chunks saw to it)
    assert sig_s is not None and wor_s is not None and sig_p is not None and wor_p is not None
    out["scores"] = Bound(sig_s.reshape(B, H, T, S), wor_s.reshape(B, H, T, S))
    out["attn_weights"] = Bound(sig_p.reshape(B, H, T, S), wor_p.reshape(B, H, T, S))
    return {name: out[name] for name in order}, tols


def _tolerance_into(sigma: np.ndarray, worst: np.ndarray, extra: Any, out: np.ndarray, buf: Scratch) -> None:
    """``out = LAMBDA·sigma + (worst + extra)`` (``extra``: a reference error), in place: the numbers
    of ``Bound(sigma, worst)`` widened by :meth:`GoldenCase.with_reference_error`, then
    :meth:`Bound.tolerance`."""
    if isinstance(extra, float) and extra == 0.0:
        w = worst
    else:
        w = np.add(worst, extra, out=buf("tol_w", worst.shape))
    np.multiply(sigma, LAMBDA, out=out)
    out += w


def worst_case_tolerances(golden: GoldenCase, dtype: str,
                          table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The ``precision="worst-case"`` bound: any correct algorithm accumulating in ``dtype``.

    Each stage: propagated error of its inputs + γ_d(n + k)·Σ|aᵢbᵢ| of its own
    arithmetic, in any summation order (docs/tolerances.md).  Infinite where
    n·u ≥ 1: such stages are uninformative, never a pass.
    """
    u, k = table.dtypes[dtype].unit_roundoff, table.extra_ops
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    vis = golden.visible

    def linear(x_abs, e_x, wm, b):
        x_hi = x_abs if e_x is None else x_abs + e_x
        mag = x_hi @ np.abs(wm) + (0.0 if b is None else np.abs(b))
        local = gamma(wm.shape[0] + k, u) * mag
        return local if e_x is None else e_x @ np.abs(wm) + local

    with np.errstate(invalid="ignore", over="ignore"):
        e_q = linear(np.abs(golden.inputs["query"]), None, w["w_q"], w.get("b_q"))
        e_k = linear(np.abs(golden.inputs["key"]), None, w["w_k"], w.get("b_k"))
        e_v = linear(np.abs(golden.inputs["value"]), None, w["w_v"], w.get("b_v"))
        q_abs, k_abs = np.abs(heads(g["q_proj"], H)), np.abs(heads(g["k_proj"], G, group))
        scale = float(cfg.scale)  # type: ignore[arg-type]
        hi = scale * ((q_abs + heads(e_q, H)) @ _t(k_abs + heads(e_k, G, group)))
        e_s = (hi - scale * (q_abs @ _t(k_abs))) + gamma(cfg.D_k + k, u) * hi
        p, s = g["attn_weights"], g["scores"]
        S = s.shape[-1]
        row_max = np.max(np.where(vis, np.abs(s), 0.0), axis=-1, keepdims=True)
        e_p = _softmax_worst(p, np.where(vis, e_s, 0.0)) + p * (gamma(S + k, u) + u * (np.abs(s) + row_max))
        e_p = np.where(vis, np.minimum(np.nan_to_num(e_p, nan=np.inf), 1.0), 0.0)
        v_abs = np.abs(heads(g["v_proj"], G, group))
        v_hi = v_abs + heads(e_v, G, group)
        hi_o = (p + e_p) @ v_hi
        e_o = (hi_o - p @ v_abs) + gamma(S + k, u) * hi_o
        e_c = merge(e_o)
        e_y = linear(np.abs(g["concat"]), e_c, w["w_o"], w.get("b_o"))
    floor = table.dtypes[dtype].floor
    out = {
        "q_proj": e_q, "k_proj": e_k, "v_proj": e_v, "scores": e_s, "attn_weights": e_p,
        "head_outputs": e_o, "concat": e_c, "output": e_y,
    }
    out = {name: np.nan_to_num(b, nan=np.inf) + floor for name, b in out.items()}
    out["attn_weights"] = np.where(vis, out["attn_weights"], 0.0)
    return out


def stage_tolerances(golden: GoldenCase, dtype: str, table: ToleranceTable = DEFAULT_TOLERANCES,
                     precision: str = "standard", reference_error: bool = False) -> dict[str, np.ndarray]:
    """The element-wise tolerance of every golden stage (``LAMBDA·sigma + worst``); those of the
    (B, H, T, S) stages are formed chunk by chunk, and their bounds are not kept.  With
    ``reference_error``, the golden's own error is in them: the numbers of
    ``golden.with_reference_error(stage_tolerances(golden, dtype))``, formed in the chunks."""
    return _golden(golden, dtype, precision, table, bounds=False, tolerances=True, reference_error=reference_error)[1]


# --- local bounds: each stage from the adapter's own previous stage(s) ---------------------

#: stage -> the stages it is recomputed from in a local check (spec/stages.py)
LOCAL_INPUTS: dict[str, tuple[str, ...]] = {n: REGISTRY[n].local_inputs for n in STAGES if REGISTRY[n].local_inputs}


def _weights_route(P: np.ndarray, own_softmax: tuple[np.ndarray, ...] | None, golden_softmax: Any) -> np.ndarray:
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
            return _inf_for_nan(np.abs(P - ref) + Bound(sig, wor).tolerance(LAMBDA))
    _, sig, wor = golden_softmax()
    return 2.0 * Bound(sig, wor).tolerance(LAMBDA)


def _nonnegative_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """An upper bound of ``a @ b`` for non-negative ``a`` (N, T, S) and ``b`` (N, S, E), in float64:
    the computed sum is below the exact one by at most γ₆₄(S) relative."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = a @ b
    return _inf_for_nan(out * (1 + gamma(a.shape[-1], U64)))


def local_references(golden: GoldenCase, own: Mapping[str, np.ndarray], dtype: str,
                     precision: str = "standard",
                     table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, tuple[np.ndarray, Bound]]:
    """{stage: (float64 recomputation from the adapter's own inputs, its bound)}.

    ``own`` holds the adapter's stages as float64 arrays of the canonical
    shapes (those it did not return, or returned malformed, are absent).  A
    stage is recomputed only when every stage it depends on is in ``own``.
    The bound is that stage's own rounding plus the storage rounding of its
    inputs as returned (the adapter may have used them unrounded); nothing
    propagated from earlier stages.
    """
    un = _units(dtype, table)
    worst_case = precision == "worst-case"
    u = un.u
    ua = u if worst_case else un.acc
    k = table.extra_ops
    cfg, w = golden.spec.config, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    vis = golden.visible
    floor = table.dtypes[dtype].floor
    out: dict[str, tuple[np.ndarray, Bound]] = {}

    def bound(var: np.ndarray, worst: np.ndarray) -> Bound:
        if worst_case:  # every rounding counted at its full size, no averaging
            return Bound(np.zeros_like(worst), _inf_for_nan(np.sqrt(var) * LAMBDA + worst) + floor)
        return Bound(np.sqrt(np.maximum(var, 0.0)), _inf_for_nan(worst + floor))

    def has(*names: str) -> bool:
        return all(n in own for n in names)

    u2 = u**2
    B, _, T, S = golden.visible.shape
    N = B * H
    visN = golden.visible.reshape(N, T, S)

    fast = not worst_case  # the in-place path (standard contract), the general one where it cannot
    compiled = _kernels_for(golden) if fast else None

    def each(fn: Any) -> None:  # fn(n, r, scratch) on every chunk of (N, T, ·) rows
        _each_chunk(N, T, S, fn)

    def finish(ref: np.ndarray, sig: np.ndarray, wor: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, Bound]:
        return ref.reshape(shape), Bound(sig.reshape(shape), wor.reshape(shape))

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if has("q_proj", "k_proj"):
            def keys() -> tuple[np.ndarray, _Pair, _Pair]:  # shared by the blocks of a batch entry
                K = heads(own["k_proj"], G, group).reshape(N, S, -1)
                return K, _Pair.of(_t(K * K)), _Pair.of(_t(np.abs(K)))

            Q = heads(own["q_proj"], H).reshape(N, T, -1)
            K, K2, aK = golden.memoised(("local keys",), keys)
            ref, sig, wor = np.empty((N, T, S)), np.empty((N, T, S)), np.empty((N, T, S))
            g_d = float(gamma(cfg.D_k + k, ua))

            def scores(n: slice, r: slice, buf: Scratch) -> None:
                q = Q[n, r]
                if compiled is not None and _local_scores_compiled(compiled, q, K[n], K2[n], aK[n], scale, u, g_d,
                                                                   floor, (ref[n, r], sig[n, r], wor[n, r]), buf):
                    return
                if fast and _local_scores_fast(q, K[n], K2[n], aK[n], scale, u, g_d, floor,
                                               (ref[n, r], sig[n, r], wor[n, r]), buf):
                    return
                x = scale * (q @ _t(K[n]))
                var = (2 * scale**2 * u2) * _upper32(q * q, K2[n]) + _stored(u, x, x)
                b = bound(var, (g_d * scale) * _upper32(np.abs(q), aK[n]))
                ref[n, r], sig[n, r], wor[n, r] = x, b.sigma, b.worst

            each(scores)
            out["scores"] = finish(ref, sig, wor, (B, H, T, S))
        g_s = float(gamma(S + k, ua))

        def softmax_pass(scores_: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """The softmax of ``scores_`` (B, H, T, S) and its own rounding bound (sigma, worst)."""
            sO = scores_.reshape(N, T, S)
            ref, sig, wor = np.empty((N, T, S)), np.empty((N, T, S)), np.empty((N, T, S))

            def weights(n: slice, r: slice, buf: Scratch) -> None:
                s_, vis = sO[n, r], visN[n, r]
                if compiled is not None and _compiled(compiled, "local_weights_chunk", s_, vis, u2, ua, g_s, floor,
                                                      ref[n, r], sig[n, r], wor[n, r], buf("k_rows", (8, S))):
                    return
                if fast and _local_weights_fast(s_, vis, u, ua, g_s, floor, (ref[n, r], sig[n, r], wor[n, r]), buf):
                    return
                x = softmax_visible(s_, vis)
                s2 = np.where(vis, _stored(u, s_), 0.0)  # the scores as returned may be rounded copies
                row_max = np.max(np.where(vis, np.abs(s_), 0.0), axis=-1, keepdims=True)
                worst = x * (g_s + ua * (np.abs(s_) + row_max))
                tau = np.where(vis, LAMBDA * np.sqrt(s2), 0.0)
                if worst_case:
                    b = bound(_stored(u, x), worst + _softmax_worst(x, tau))
                else:  # relative form: ref² underflows for tiny weights
                    b = Bound(_inf_for_nan(x * np.sqrt(_softmax_rel2(x, s2) + u2 + U64**2)),
                              _inf_for_nan(worst + _second_order(x, tau)) + floor)
                ref[n, r], sig[n, r], wor[n, r] = x, np.where(vis, b.sigma, 0.0), np.where(vis, b.worst, 0.0)

            each(weights)
            return ref, sig, wor

        weights_local = None
        if has("scores"):
            weights_local = softmax_pass(own["scores"])
            out["attn_weights"] = finish(*weights_local, (B, H, T, S))
        if has("attn_weights", "v_proj"):
            def values() -> tuple[np.ndarray, _Pair, _Pair]:  # shared by the blocks of a batch entry
                V = heads(own["v_proj"], G, group).reshape(N, S, -1)
                return V, _Pair.of(V * V), _Pair.of(np.abs(V))

            P = own["attn_weights"].reshape(N, T, S)
            V, V2, aV = golden.memoised(("local values",), values)
            E = V.shape[-1]
            ref, sig, wor = np.empty((N, T, E)), np.empty((N, T, E)), np.empty((N, T, E))

            def outputs(n: slice, r: slice, buf: Scratch) -> None:
                pc = P[n, r]
                if compiled is not None and _local_outputs_fast(pc, V[n], V2[n], aV[n], u, g_s, floor,
                                                                (ref[n, r], sig[n, r], wor[n, r]), buf, compiled):
                    return
                if fast and _local_outputs_fast(pc, V[n], V2[n], aV[n], u, g_s, floor,
                                                (ref[n, r], sig[n, r], wor[n, r]), buf):
                    return
                x = pc @ V[n]
                var = (2 * u2) * _upper32(pc * pc, V2[n]) + _stored(u, x, x)
                b = bound(var, g_s * _upper32(np.abs(pc), aV[n]))
                ref[n, r], sig[n, r], wor[n, r] = x, b.sigma, b.worst

            each(outputs)
            route = _weights_route(P, weights_local, lambda: softmax_pass(golden.stages["scores"]))
            wor += _nonnegative_product(route, aV.f64)
            out["head_outputs"] = finish(ref, sig, wor, (B, H, T, E))
        if has("head_outputs"):
            ref = merge(own["head_outputs"])
            out["concat"] = (ref, bound(_stored(u, ref), np.zeros_like(ref)))
        if has("concat"):
            c, bo = own["concat"], w.get("b_o")
            cw = c @ w["w_o"]
            ref = cw if bo is None else cw + bo
            var = (u**2 * c**2) @ w["w_o"] ** 2 + _stored(u, cw, ref)
            mag = np.abs(c) @ np.abs(w["w_o"]) + (0.0 if bo is None else np.abs(bo))
            out["output"] = (ref, bound(var, gamma(w["w_o"].shape[0] + k, ua) * mag))
    return out
