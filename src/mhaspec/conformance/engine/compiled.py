"""The compiled path of the chunk loops: which cases take it, with which implementation, and the
calls into its loops, the model's rules by the same formulas.

Two implementations of the same loops (:mod:`.kernels`' names and arguments): the library built at
install time (:mod:`.native`, C, ``csrc/``; no cost in the process but its load) and numba's
(:mod:`.kernels`, the ``fast`` extra; compiled in every process, ~4 s).  A case of more than
:data:`NATIVE_MIN_ELEMENTS` per (B, H, T, S) stage takes the library where it loads; else one of more
than :data:`COMPILED_MIN_ELEMENTS` takes numba where it is installed; else the NumPy loops
(:func:`kernels_for_shape`; :data:`LOOPS_ENV` chooses otherwise).  Each function here returns False
where a value is not finite, or where the loop cannot run (:func:`run`: numba cannot compile it, the
library refuses its arguments: it warns once, and the process goes on without that implementation); a
library that lacks a loop (built from another mhaspec) is not loaded at all (:mod:`.native`).  The products
stay in BLAS.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from ...fixtures import GoldenCase
from .. import judging
from ..compare import Scratch
from ..model import variants
from ..model.forward import AttentionConstants
from ...spec.masks import seen_keys
from ..model.vocabulary import U32, U64, Acc, Bound, Error, Pair, Rounding, gamma, stored, swap
from . import inplace


#: A case with more elements than this per (B, H, T, S) stage (30·2^20 ≈ 2^24.9, H = 8, T = S = 1983;
#: the whole case's, also where it is judged in blocks of query rows) takes the numba loops where the
#: library (:data:`NATIVE_MIN_ELEMENTS`) is not built and numba is installed (:func:`kernels_for`).
#: Numba compiles them once per process: 4.1–4.3 s
#: of CPU with its import (``python benchmarks/bench_compile.py``).  Against the NumPy loops they save,
#: in a float32 run, 1.1–1.4·10^-7 s of CPU per element at T = S = 1024, H = 8 (2^23; the runner's CPU:
#: 3.65 s with the NumPy loops, 6.8 s compiled, compilation included) and 0.93–1.02·10^-7 at
#: T = S = 4096 (2^27: 45.7 s and 36.3–37.3 s), so a one-dtype run breaks even at 2^24.9–2^25.5
#: elements: this threshold is its lower end (4.3 s / 1.4·10^-7), which keeps T = S = 2048 (2^25,
#: within the range: a one-dtype run there gains or loses about a second) on the compiled loops that
#: a four-dtype run wins from about 2^23 on (docs/tolerances.md).  The committed catalog's cases (at
#: most 2^15) never take it.
COMPILED_MIN_ELEMENTS = 30 << 20

#: A case with more elements than this per (B, H, T, S) stage (2^20: H = 8, T = S = 363; the whole case's)
#: takes the library's loops where it is built (:mod:`.native`).  They cost a process nothing up front but
#: the library's load (0.6–0.7 ms, ``python benchmarks/bench_compile.py``), and per chunk one ctypes call
#: (~75 µs, 0.3 ns per element of a 2^18 chunk): the golden bounds' chunks took less thread CPU by the
#: library than by the NumPy loops at every size measured, 2^9 to 2^17 elements (70–900 ns per element
#: less, a loaded 2-core machine; benchmarks/results/2026-12-07-s5-attn.md), so there is no break-even
#: to derive: this threshold keeps the NumPy loops' bit-for-bit bounds for the committed catalog's cases
#: (at most 2^15) and the tests' (tests/test_blocks.py, test_compare.py, test_second_opinion.py,
#: test_large_sizes.py, test_tolerance_model.py pass with it; a lower one was not tried), and takes the
#: library from well below T = S = 1024 (2^23) on.
NATIVE_MIN_ELEMENTS = 1 << 20

#: Elements of a chunk of the compiled loop: it sweeps each row a few times in the L1 cache
#: whatever the chunk's size, and larger chunks make larger, faster products (2^16: 1.10 s,
#: 2^18: 0.86 s for the golden tolerances at T = S = 2048, docs/tolerances.md).
COMPILED_CHUNK_ELEMENTS = 1 << 18

#: ``MHASPEC_LOOPS``: ``auto`` (the default: by the thresholds above), ``numpy`` (the NumPy loops
#: only), ``native`` or ``numba`` (that implementation for every case, whatever its size: for
#: measurements and tests; a loop it cannot run falls back as in ``auto``).
LOOPS_ENV = "MHASPEC_LOOPS"
LOOPS = ("auto", "numpy", "numba", "native")

#: ``MHASPEC_NUMBA=off`` (or ``0``, ``no``, ``false``): the NumPy chunk loops, no compiled ones at all
#: (``MHASPEC_LOOPS=numpy``, which it overrides; its spelling from before the library).
NUMBA_ENV = "MHASPEC_NUMBA"
_OFF = {"0", "off", "no", "false", "none"}

#: The implementations that failed in this process (their name: the first error); not tried again.
_BROKEN: dict[str, str] = {}
_COMPILE_LOCK = threading.Lock()


def loops_mode() -> str:
    """The implementation asked for (:data:`LOOPS_ENV`, :data:`NUMBA_ENV`): one of :data:`LOOPS`."""
    if os.environ.get(NUMBA_ENV, "").strip().lower() in _OFF:
        return "numpy"
    mode = os.environ.get(LOOPS_ENV, "").strip().lower() or "auto"
    if mode not in LOOPS:
        raise ValueError(f"{LOOPS_ENV}={mode!r}: not one of {', '.join(LOOPS)}")
    return mode


def _name(kernels: Any) -> str:
    """"native" (the library) or "numba" (:mod:`.kernels`)."""
    return "native" if kernels.__name__.endswith(".native") else "numba"


def kernels_for(golden: GoldenCase) -> Any:
    """:func:`kernels_for_shape` for ``golden``, sized by the whole case where it is one block of query
    rows (:mod:`mhaspec.conformance.blocks`): what pays back the compilation is the whole case's work,
    and a large case is judged in blocks smaller than :data:`COMPILED_MIN_ELEMENTS`."""
    B, H, T, S = judging.whole_shape(golden)
    return kernels_for_shape(B * H, T, S)


def kernels_for_shape(N: int, T: int, S: int) -> Any:
    """The compiled chunk loops for a (N, T, S) case: the library (:mod:`.native`) above
    :data:`NATIVE_MIN_ELEMENTS` where it loads, else numba's (:mod:`.kernels`) above
    :data:`COMPILED_MIN_ELEMENTS` where it is installed; None (the NumPy loops): a small case, neither
    there, switched off (:data:`LOOPS_ENV`, :data:`NUMBA_ENV`), or failed."""
    mode = loops_mode()
    if mode in ("auto", "native") and (mode == "native" or N * T * S > NATIVE_MIN_ELEMENTS):
        native = _native()
        if native is not None:
            return native
    return _numba(mode, N * T * S)


def _native() -> Any:
    """The library's loops (:mod:`.native`), or None: not built, stale, or failed in this process."""
    if "native" in _BROKEN:
        return None
    try:
        from . import native
    except ImportError:  # no C compiler at install time (or a stale build): numba or NumPy, same verdicts
        return None
    return native


def _numba(mode: str, elements: int) -> Any:
    """numba's loops (:mod:`.kernels`) where ``mode`` and the case's ``elements`` call for them, or None."""
    if "numba" in _BROKEN or mode == "numpy" or (mode != "numba" and elements <= COMPILED_MIN_ELEMENTS):
        return None
    try:
        from . import kernels
    except ImportError:  # numba absent (or unusable with this NumPy): the NumPy loops, same bounds
        return None
    return kernels


_DUMMY = np.empty((1, 1, 1))


def run(kernels: Any, name: str, *args: Any) -> bool:
    """``kernels.name(*args)``; False (the caller takes the NumPy loop) where the loop cannot run
    (:func:`call`)."""
    result = call(kernels, name, *args)
    return result is not _FAILED and bool(result)


#: What :func:`call` returns where the loop could not run.
_FAILED = object()


def call(kernels: Any, name: str, *args: Any) -> Any:
    """``kernels.name(*args)``, or :data:`_FAILED` where it cannot run: numba cannot compile it or the
    library refuses its arguments (warned once; that implementation is then left for the rest of the
    process)."""
    impl = _name(kernels)
    if impl in _BROKEN:  # an earlier chunk's failure: numba would try (and fail) to compile it again
        return _FAILED
    try:
        return kernels.call(name, *args)
    except kernels.ERRORS as exc:
        with _COMPILE_LOCK:
            if impl not in _BROKEN:
                _BROKEN[impl] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                what = ("numba could not compile the tolerance loop" if impl == "numba" else
                        f"the compiled loops' library ({kernels.LIBRARY}) could not run {name}")
                warnings.warn(f"mhaspec: {what} ({_BROKEN[impl]}); the NumPy loops are used instead (the same "
                              f"verdicts, slower)", RuntimeWarning, stacklevel=3)
        return _FAILED


def attention_chunk(kernels: Any, c: AttentionConstants, Q: np.ndarray, tQ2: np.ndarray, KK: Pair,
                    aK: Pair, V: np.ndarray, V2: np.ndarray, aV: Pair, tV2: Pair, s: np.ndarray,
                    p: np.ndarray, o: np.ndarray, vis: np.ndarray, *,
                    bounds: tuple[Bound, Bound] | None, tolerances: tuple[np.ndarray, ...] | None,
                    extras: tuple[Any, Any], out: Error, buf: Scratch, lse_rows: np.ndarray | None = None) -> bool:
    """:func:`.inplace.attention_chunk` by the compiled loop (:func:`.kernels.attention_chunk`): the bounds
    of the scores and the attention weights into ``bounds`` (sigma and worst of each) and/or their
    tolerances with the reference error ``extras`` into ``tolerances`` (as :func:`.inplace.tolerance_into`),
    the error (var, acc) of the head outputs into ``out``; False (nothing to trust) where a value is not finite.
    ``lse_rows`` ((heads, rows, :data:`GOLDEN_LSE_PARTS`), where :func:`folds_golden_lse`): each row's golden
    lse operands too, from the same work (:func:`golden_lse`)."""
    u2 = c.u**2
    shape = s.shape
    S = shape[-1]
    k = seen_keys(vis)  # the keys the chunk's rows see: the products and the loop's sums stop there
    seen = (*shape[:-1], k)
    lhs_in = np.concatenate([tQ2 / u2, Q * Q], axis=-1)
    m1, m2 = buf("k_m1", seen, np.float32), buf("k_m2", seen, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul(lhs_in.astype(np.float32), KK.f32[..., :k], out=m1)  # upper32's products, factors in c1, c2
        np.matmul(np.abs(Q).astype(np.float32), aK.f32[..., :k], out=m2)
    c1 = c.scale**2 * u2 * (1 + 2 * float(gamma(lhs_in.shape[-1] + 2, U32)))
    c2 = c.scale * (1 + 2 * float(gamma(Q.shape[-1] + 2, U32)))  # m = scale·|Q||K|ᵀ, then γ_d·m, σ_d·m
    lhs, q, pk = buf("k_lhs", seen), buf("k_q", seen), buf("k_pk", shape[:-1])
    pp32, lhs32 = buf("k_pp32", seen, np.float32), buf("k_lhs32", seen, np.float32)
    # the reference errors: both arrays, or both values (the two arrays of a float64 golden are 0)
    arrays = not all(isinstance(e, float) for e in extras)
    ext: list[Any] = [arrays]
    for e in extras:
        ext += ([np.broadcast_to(e, shape), 0.0] if arrays else [_DUMMY, float(e)])
    with np.errstate(over="ignore", invalid="ignore"):
        ok = run(
            kernels, "attention_chunk" if lse_rows is None else "attention_lse_chunk", s, p, vis, m1, m2, c1, c2,
            c.a_d.worst, c.a_d.sigma, u2, c.ua, c.a_s.worst, c.a_s.sigma, c.floor, 1.0,
            bounds is not None, *((*bounds[0], *bounds[1]) if bounds else (_DUMMY,) * 4), tolerances is not None,
            *(ext if tolerances is not None else (False,) + (_DUMMY, 0.0) * 2), *(tolerances or (_DUMMY,) * 2),
            lhs, q, pp32, lhs32, pk, buf("k_rows", (10, S)), k, *(() if lse_rows is None else (lse_rows,)))
        if not ok:
            return False
        # 4. head outputs, as inplace.attention_chunk, over the keys seen (the weights beyond: 0); the
        #    float32 products' factor of the whole row's length, as where no key is left out
        f32 = 1 + 2 * float(gamma(S + 2, U32))
        o2 = (np.maximum(lhs @ V2[:, :k] - 2 * o * (q @ V[:, :k]) + o * o * pk[..., None], 0.0)
              + (u2 * f32) * (pp32 @ tV2.f32[:, :k]) + stored(c.u, o, o))
        wo = lhs32 @ aV.f32[:, :k]
        if not inplace.finite(o2, wo):
            return False
    out.var[...] = o2
    np.multiply(wo, f32, out=out.acc, dtype=np.float64)
    return True


def local_scores(kernels: Any, q: np.ndarray, K: np.ndarray, K2: Pair, aK: Pair, scale: float,
                 u: float, a_d: Acc, floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray],
                 buf: Scratch, vis: np.ndarray | None = None) -> bool:
    """:func:`.inplace.local_scores` with its elementwise passes in one compiled sweep
    (:func:`.kernels.local_scores_chunk`); with the chunk's visibility ``vis``, over the keys its rows see
    only (:func:`~mhaspec.spec.masks.seen_keys`: masked scores are not compared; later keys get 0)."""
    ref, sig, wor = out
    k = ref.shape[-1] if vis is None else seen_keys(vis)
    np.matmul(q, swap(K[:, :k]), out=ref[..., :k])
    m_sig, m_wor = (buf(name, (*ref.shape[:-1], k), np.float32) for name in ("k_ls_sig", "k_ls_wor"))
    with np.errstate(over="ignore", invalid="ignore"):
        np.matmul((q * q).astype(np.float32), K2.f32[..., :k], out=m_sig)
        np.matmul(np.abs(q).astype(np.float32), aK.f32[..., :k], out=m_wor)
    f32 = 1 + 2 * float(gamma(q.shape[-1] + 2, U32))  # inplace.product32's factor
    return run(kernels, "local_scores_chunk", ref, m_sig, m_wor, scale, 2 * scale**2 * u * u * f32,
               2 * u * u + U64**2, a_d.worst * scale * f32, a_d.sigma * scale * f32, floor, sig, wor, k)


def local_weights(kernels: Any, s: np.ndarray, vis: np.ndarray, u: float, ua: float, a_s: Acc, floor: float,
                  out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch,
                  lse_rows: np.ndarray | None = None) -> bool:
    """:func:`.inplace.local_weights` by the compiled loop (:func:`.kernels.local_weights_chunk`), over the
    keys the chunk's rows see (:func:`~mhaspec.spec.masks.seen_keys`; later keys: a masked key's 0);
    ``lse_rows`` ((heads, rows, :data:`LSE_PARTS`), where :func:`folds_lse`): each row's local lse operands too,
    from the same work (:func:`local_lse`)."""
    ref, sig, wor = out
    args = (s, vis, u**2, ua, a_s.worst, a_s.sigma, floor, ref, sig, wor, buf("k_rows", (8, s.shape[-1])),
            seen_keys(vis))
    if lse_rows is None:
        return run(kernels, "local_weights_chunk", *args)
    return run(kernels, "local_weights_lse_chunk", *args, lse_rows)


#: What the compiled weights loop writes per row for the local lse check (csrc/local.c): the peak, Σ e^{s−peak},
#: Σ p·τ, Σ p·(e^τ − 1), Σ p·(e^{−τ} − 1), Σ p²·T_s², max|s| over the visible keys.
LSE_PARTS = 7


def folds_lse(kernels: Any) -> bool:
    """Whether ``kernels``' weights loop also forms the local lse check's operands (the C library's does:
    the lse then costs no second softmax; numba's does not, and its path computes it by NumPy)."""
    return getattr(kernels, "local_weights_lse_chunk", None) is not None


def local_lse(rows: np.ndarray, a_s: Acc, r: Rounding) -> tuple[np.ndarray, Error]:
    """(lse (…, 1), its error) from the compiled weights loop's ``rows`` (…, :data:`LSE_PARTS`), by
    :func:`~mhaspec.conformance.model.variants.lse`'s own formulas (:func:`lse_of_rows`): lse = peak +
    log Σ e^{s−peak}, −inf where the row sees no key."""
    peak, total = rows[..., 0:1], rows[..., 1:2]
    with np.errstate(divide="ignore"):
        lse_ = np.where(total > 0, peak + np.log(total), -np.inf)
    return lse_, lse_of_rows(rows[..., 2:], lse_, a_s, r)


#: What the compiled attention loop writes per row for the golden lse (csrc/attention_rows.h): Σ p·τ,
#: Σ p·(e^τ − 1), Σ p·(e^{−τ} − 1), Σ p²·T_s², max|s| over the visible keys (the last five of
#: :data:`LSE_PARTS`: the golden's lse is its own).
GOLDEN_LSE_PARTS = 5


def folds_golden_lse(kernels: Any) -> bool:
    """Whether ``kernels``' attention loop also forms the golden lse's operands (the C library's does: the
    lse's bound then costs no second pass over the rows; numba's does not, and its path computes it by NumPy,
    :func:`~.variants.scores_lse`)."""
    return getattr(kernels, "attention_lse_chunk", None) is not None


def lse_of_rows(rows: np.ndarray, lse_: np.ndarray, a_s: Acc, r: Rounding) -> Error:
    """The error of ``lse_`` (…, 1) from a compiled loop's ``rows`` (…, :data:`GOLDEN_LSE_PARTS`) by
    :func:`~mhaspec.conformance.model.variants.lse`'s own formulas (:func:`~.variants.lse_exact`,
    :func:`~.variants.lse_error`): the golden lse's (:func:`attention_chunk`'s ``lse_rows``), the local one's
    (:func:`local_lse`)."""
    first, up, down, pk, row_max = (rows[..., k:k + 1] for k in range(GOLDEN_LSE_PARTS))
    return variants.lse_error(lse_, first, variants.lse_exact(up, down), pk, row_max, a_s, r)


def local_outputs(kernels: Any, pc: np.ndarray, V: np.ndarray, V2: Pair, aV: Pair, u: float, a_s: Acc,
                  floor: float, out: tuple[np.ndarray, np.ndarray, np.ndarray], buf: Scratch,
                  nonzero_only: bool = False) -> bool:
    """:func:`.inplace.local_outputs` with the float32 operands p² and |p| of its bound products formed
    in one compiled sweep (:func:`.kernels.local_outputs_operands`), the same numbers (``nonzero_only``:
    as there)."""
    sq, ab = buf("k_lo_pp", pc.shape, np.float32), buf("k_lo_ap", pc.shape, np.float32)
    if not run(kernels, "local_outputs_operands", pc, sq, ab):
        return False
    return inplace.local_outputs(pc, V, V2, aV, u, a_s, floor, out, buf, operands=(sq, ab), nonzero_only=nonzero_only)


def loaded_kernels() -> Any:
    """The compiled loops where a large case has already brought them into this process (the library,
    else numba's; allowed by :data:`LOOPS_ENV`, not failed), else None: a stage's comparison
    (:func:`passing_stage`) takes them only then, never loading either for a small case."""
    mode = loops_mode()
    if mode == "numpy":
        return None
    for impl, module in (("native", "native"), ("numba", "kernels")):
        loaded = sys.modules.get(f"{__package__}.{module}")
        if loaded is not None and impl not in _BROKEN and mode in ("auto", impl):
            return loaded
    return None


def _three_d(a: np.ndarray) -> np.ndarray:
    """``a`` as (N, R, C), a view where its leading axes merge (a block's, a broadcast's)."""
    if a.ndim == 3:
        return a
    if a.ndim < 3:
        return a.reshape((1,) * (3 - a.ndim) + a.shape)
    return a.reshape(-1, *a.shape[-2:])


class Ordinary(NamedTuple):
    """What :func:`ordinary_stage` found in a passing stage."""

    compared: int
    max_abs_err: float
    max_rel_err: float
    worst_ratio: float
    worst_flat: int  # in the whole (unmasked) array, C order
    z2: float
    n_z: int  # elements with sigma > 0
    golden_above_tolerance: bool  # a zero result would fail


def ordinary_stage(kernels: Any, v: np.ndarray, g: np.ndarray, tol: np.ndarray,
                   noise: tuple[np.ndarray, np.ndarray] | None, visible: np.ndarray | None,
                   check_float32: bool) -> Ordinary | None:
    """A stage's figures by the compiled sweep (:func:`.kernels.ordinary_stage`, or the library's
    ``mh_ordinary_stage``, csrc/stage.c, where ``kernels`` is :mod:`.native`), or None where an element is
    out of the ordinary or the loop cannot be compiled: the caller judges it by NumPy.  Every array is
    broadcast to ``v``'s shape (a view)."""
    shape = v.shape
    sig, wor = (tol, tol) if noise is None else noise
    vis = np.zeros((1, 1, 1), dtype=np.uint8) if visible is None else visible
    arrays = [_three_d(np.broadcast_to(a, shape)) for a in (v, g, tol, sig, wor)]
    vis3 = vis if visible is None else _three_d(np.broadcast_to(vis, shape).view(np.uint8))
    result = call(kernels, "ordinary_stage", *arrays, vis3, visible is not None, noise is not None, check_float32)
    if result is _FAILED or not result[0]:
        return None
    return Ordinary(int(result[1]), float(result[2]), float(result[3]), float(result[4]), int(result[5]),
                    float(result[6]), int(result[7]), bool(result[8]))


#: The compiled sums of squares (csrc/stage.c) by the dtype of the values they read; the golden: float64.
_SUM_SQUARES = {np.dtype(np.float64): "sum_squares", np.dtype(np.float32): "sum_squares_f4"}
_NO_MASK = np.zeros((1, 1, 1), dtype=np.uint8)


def _three_d_views(a: np.ndarray) -> list[np.ndarray]:
    """``a`` as (N, R, C) views: one per index of the axes before its last three (a reshape that merges
    them copies a broadcast view, a visibility of (B, 1, T, S) broadcast over the heads), or ``a`` with
    leading axes of 1."""
    if a.ndim < 3:
        return [a.reshape((1,) * (3 - a.ndim) + a.shape)]
    return [a[index] for index in np.ndindex(*a.shape[:-3])]


def sum_squares(kernels: Any, values: np.ndarray, golden: np.ndarray | None, selected: np.ndarray | None) -> float | None:
    """Σ (values − golden)² (Σ values² without ``golden``) over the elements where ``selected`` is True (None:
    every element), in float64, by the compiled sweep (csrc/stage.c ``mh_sum_squares``): the arrays read in
    place, with any strides (``golden`` and ``selected`` broadcast to ``values``' shape), nothing gathered;
    the NumPy sum's terms, added in the sweep's fixed order.  A NaN or infinity selected makes it NaN or inf,
    as NumPy's.  None where the loops have no such sweep (numba's), where the dtypes are others (``values``
    float64 or float32, ``golden`` float64) or the call fails: the caller sums by NumPy."""
    name = _SUM_SQUARES.get(values.dtype)
    if name is None or getattr(kernels, name, None) is None or (golden is not None and golden.dtype != np.float64):
        return None
    parts = _three_d_views(values)
    g = [_DUMMY] * len(parts) if golden is None else _three_d_views(np.broadcast_to(golden, values.shape))
    m = ([_NO_MASK] * len(parts) if selected is None
         else _three_d_views(np.broadcast_to(selected, values.shape).view(np.uint8)))
    total = 0.0
    for v_part, g_part, m_part in zip(parts, g, m):
        part = call(kernels, name, v_part, g_part, m_part, golden is not None, selected is not None)
        if part is _FAILED:
            return None
        total += part[0]
    return total
