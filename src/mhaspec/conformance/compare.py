"""Judging one stage: shape, dtype, finiteness, precision, then element-wise error."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

PASS, FAIL, NOT_EXPOSED, KNOWN_DEVIATION = "pass", "fail", "not exposed", "known deviation"
#: a stage the dtype cannot resolve for this case (a zero result would pass): never a pass
UNINFORMATIVE = "uninformative"


@dataclass
class StageResult:
    """The verdict on one stage of one case in one dtype.

    ``worst_ratio`` is error/tolerance at the worst element (<= 1 passes) and
    ``worst_index`` that element's index in the canonical stage shape.
    """

    stage: str
    verdict: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    worst_ratio: float | None = None
    worst_index: tuple[int, ...] | None = None
    compared: int = 0
    message: str = ""
    reason: str = ""  # a known deviation's declared reason
    nonfinite: int = 0
    rms_ratio: float | None = None  # root-mean-square of error/tolerance (the systematic-error test)
    local_worst_ratio: float | None = None  # the local check's worst error/tolerance, if it ran
    failed_check: str = ""  # "golden", "local" or "golden+local" when the stage fails
    imprecise: bool = False  # fails the standard precision contract, passes the worst-case bound
    #: a known deviation excused by a bounded declaration: its bound (``Deviation.within``), and the
    #: worst error/bound ratio the stage reached against that widened bound (<= 1: it held)
    within: str | float | None = None
    within_ratio: float | None = None
    #: the same-precision second opinion (:class:`~mhaspec.conformance.second_opinion.SecondOpinion`), if judged
    second_opinion: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "verdict": self.verdict,
            "max_abs_err": _num(self.max_abs_err),
            "max_rel_err": _num(self.max_rel_err),
            "worst_ratio": _num(self.worst_ratio),
            "worst_index": list(self.worst_index) if self.worst_index is not None else None,
            "compared": self.compared,
            "nonfinite": self.nonfinite,
            "rms_ratio": _num(self.rms_ratio),
            "local_worst_ratio": _num(self.local_worst_ratio),
            "failed_check": self.failed_check,
            "imprecise": self.imprecise,
            "within": self.within if isinstance(self.within, str) else _num(self.within),
            "within_ratio": _num(self.within_ratio),
            "second_opinion": None if self.second_opinion is None else self.second_opinion.to_json(),
            "message": self.message,
            "reason": self.reason,
        }


def worst_check_ratio(res: StageResult) -> float | None:
    """The largest ratio of any check of ``res`` — golden (``worst_ratio``), local, systematic
    (``rms_ratio``): the one that made it fail, if it failed on values; None when none ran."""
    ratios = [x for x in (res.worst_ratio, res.local_worst_ratio, res.rms_ratio) if x is not None]
    return max(ratios) if ratios else None


def _num(x: float | None) -> float | str | None:
    """JSON-safe number: inf and nan become the strings "inf" and "nan"."""
    if x is None:
        return None
    if np.isnan(x):
        return "nan"
    if np.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(x)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float64 values to the nearest bfloat16 (ties to even), returned as float64.

    Goes through float32 first, which is exact for every bfloat16-representable
    value (the only values this is used to recognise).
    """
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(f), out, f.astype(np.float64))


class Scratch:
    """Work arrays reused from call to call, one per name: a fresh array of a large stage costs
    its page faults.  Used by the tolerance chunk loops (one per thread) and by
    :func:`compare_stage` (one per thread, kept between calls)."""

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Any = np.float64) -> np.ndarray:
        size = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.size < size or flat.dtype != dtype:
            flat = self._flat[name] = np.empty(size, dtype)
        return flat[:size].reshape(shape)


_WORK = threading.local()


def _work(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A float64 work array of ``shape`` for :func:`compare_stage`'s intermediate results (this
    thread's :class:`Scratch`)."""
    scratch = _WORK.__dict__.get("scratch")
    if scratch is None:
        scratch = _WORK.scratch = Scratch()
    return scratch(name, shape)


def representable(values: np.ndarray, dtype: str) -> np.ndarray:
    """Boolean mask: which finite float64 ``values`` are exactly representable in ``dtype``."""
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "float64":
            return np.ones(values.shape, dtype=bool)
        if dtype == "bfloat16":
            return round_to_bfloat16(values) == values
        return values.astype(dtype).astype(np.float64) == values


#: A float16 result whose values nearly all fit bfloat16's 8 significant bits was computed in
#: bfloat16: a correct float16 value fits them with probability 1/8.  Judged on stages with
#: at least this many nonzero values, and only where the golden, rounded to float16, does not
#: itself fit them.
NARROW_MIN_VALUES = 32
NARROW_FRACTION = 0.9


def narrower_precision(values: np.ndarray, golden: np.ndarray, dtype: str) -> str:
    """Why ``values`` look computed in a narrower dtype than ``dtype`` ("" when they do not).

    Only float16 has a common narrower look-alike (bfloat16: autocast to the wrong
    16-bit type).  The worst-case bound alone cannot tell them apart.
    """
    if dtype != "float16":
        return ""
    nonzero = np.isfinite(values) & (values != 0)
    count = int(np.count_nonzero(nonzero))
    if count < NARROW_MIN_VALUES:
        return ""
    narrow = int(np.count_nonzero(representable(values[nonzero], "bfloat16")))
    with np.errstate(over="ignore"):
        expected = golden.astype(np.float16).astype(np.float64)[nonzero]
    if np.mean(representable(expected, "bfloat16")) >= NARROW_FRACTION / 2:
        return ""  # the data itself has few significant bits: not informative
    if narrow >= NARROW_FRACTION * count:
        return (f"{narrow} of {count} nonzero values have at most 8 significant bits, as bfloat16 values do "
                f"(a float16 result has more in 7 of 8 values): computed in bfloat16, not float16")
    return ""


def dtype_name(value: Any) -> str | None:
    """The name of ``value``'s NumPy dtype ("float32", "bfloat16", …); None for what has none (a framework
    tensor's dtype is not a NumPy dtype: its values are then checked)."""
    kind = getattr(value, "dtype", None)
    return kind.name if isinstance(kind, np.dtype) else None


def as_float_array(value: Any) -> tuple[np.ndarray | None, str]:
    """(float64 array, "") or (None, why it is not a floating-point array)."""
    try:
        arr = np.asarray(value)
    except Exception as exc:  # framework tensors that numpy cannot take
        return None, f"cannot convert {type(value).__name__} to a numpy array ({exc}); return numpy arrays"
    kind_ok = np.issubdtype(arr.dtype, np.floating) or arr.dtype.name in ("bfloat16", "float8_e4m3fn")
    if not kind_ok:
        return None, f"dtype {arr.dtype} is not a floating-point dtype"
    try:
        return arr.astype(np.float64, copy=False), ""  # read only: no copy of a float64 array
    except Exception as exc:
        return None, f"dtype {arr.dtype} cannot be converted to float64 ({exc})"


def compare_stage(
    stage: str,
    got: Any,
    golden: np.ndarray,
    tolerance: np.ndarray,
    dtype: str,
    visible: np.ndarray | None = None,
    *,
    noise: tuple[np.ndarray, np.ndarray] | None = None,
    rms_limit: float | None = None,
    rms_min_elements: int = 16,
    value_checks: bool = True,
    keys: int | None = None,
    returned_dtype: str | None = None,
) -> StageResult:
    """Judge ``got`` against ``golden`` (or a local recomputation) element-wise.

    For ``scores``, ``visible`` selects the compared entries (masked scores are
    not compared).  For ``attn_weights`` the tolerance is 0 where masked: those
    entries must be exactly 0.  With ``noise = (sigma, worst)`` (the two parts of
    the tolerance, :class:`~mhaspec.conformance.tolerance.Bound`) and
    ``rms_limit``, the root mean square of ``max(|error| − worst, 0) / sigma``
    over the compared elements with sigma > 0 must also stay within
    ``rms_limit`` (when there are at least ``rms_min_elements``): rounding noise
    averages far below its per-element bound, so this catches systematic
    errors that are small per element.  A stage where a
    zero result would pass is ``uninformative``, never a pass.
    ``value_checks=False`` skips the shape-independent value checks
    (finiteness is still required; representability and the narrow-precision
    fingerprint are the golden check's).  ``keys`` (a block of query rows of a causal or windowed
    case: :func:`~mhaspec.spec.masks.seen_keys`): no row sees a key from ``keys`` on, so a (…, T, S)
    stage is judged on its first ``keys`` keys (:func:`_seen_keys_only`) — the same verdict and
    figures without the NumPy passes over the entries beyond.  Not where the compiled sweep judges
    the stage (a large case, :func:`_compiled_sweep`): it reads each element once, as checking the
    entries beyond would (measured at T = S = 4096: no faster cut, and the check on top).
    ``returned_dtype`` (:func:`dtype_name` of what the adapter returned, where ``got`` is its float64
    conversion): an array of ``dtype`` itself holds only values representable in ``dtype``, so that check
    is not run again (its count is 0 by construction).
    """
    values, why = as_float_array(got)
    if values is None:
        return StageResult(stage, FAIL, message=why)
    if values.shape != golden.shape:
        return StageResult(stage, FAIL, message=f"shape {values.shape}, expected {golden.shape}")
    if keys is not None and 0 < keys < golden.shape[-1] and not _compiled_loops():
        seen = _seen_keys_only(values, golden, tolerance, visible, noise, keys)
        if seen is not None:
            v_seen, g_seen, tol_seen, visible_seen, noise_seen = seen
            res = compare_stage(stage, v_seen, g_seen, tol_seen, dtype, visible_seen, noise=noise_seen,
                                rms_limit=rms_limit, rms_min_elements=rms_min_elements, value_checks=value_checks,
                                returned_dtype=returned_dtype)
            if visible is not None:  # the same elements compared, in the same order: the same result
                return res
            if res.verdict == PASS:  # every entry beyond is 0 with a zero tolerance: exact, out of the RMS
                res.compared = golden.size
                return res
            # not a pass: judged whole below, so that its message counts every entry

    represent = value_checks and returned_dtype != dtype  # whether representability in dtype is to be checked
    if visible is not None and visible.all():
        visible = None  # the same elements in the same order, without the gathers
    if values.size > COMPARE_CHUNK and (dtype in ("float64", "float32") or not value_checks):
        swept = _compiled_sweep(stage, values, golden, tolerance, visible, noise, rms_limit, rms_min_elements,
                                dtype == "float32" and represent)
        if swept is not None:
            return swept
    if visible is None:  # every element, in the stage's shape: no copy of a strided block's view
        compared = None

        def pick(a: np.ndarray) -> np.ndarray:
            return a if a.shape == golden.shape else np.broadcast_to(a, golden.shape)
    else:  # the compared elements in C order, by a boolean mask of the stage's shape (no copy of a strided view first)
        compared = np.ascontiguousarray(np.broadcast_to(visible, golden.shape))

        def pick(a: np.ndarray) -> np.ndarray:
            return (a if a.shape == golden.shape else np.broadcast_to(a, golden.shape))[compared]

    v, g, tol = pick(values), pick(golden), pick(tolerance)
    result = StageResult(stage, PASS, compared=int(v.size))
    if v.size == 0:
        result.message = "nothing to compare (every entry is masked)"
        return result

    sigma, worst_part = (None, None) if noise is None else (pick(a) for a in noise)
    chunked = None
    if compared is None and v.size > COMPARE_CHUNK:
        chunked = _passing_in_chunks(v, g, tol, None if sigma is None or rms_limit is None else (sigma, worst_part),
                                     dtype if represent else "float64")
    if chunked is not None:  # every element ordinary and within its tolerance: the figures, chunk by chunk
        result.max_abs_err, result.max_rel_err, result.worst_ratio, worst_flat, z2_sum, n_z = chunked
        result.worst_index = tuple(int(i) for i in np.unravel_index(worst_flat, golden.shape))
        problems = []
        narrower = narrower_precision(v, g, dtype) if value_checks else ""
        if narrower:
            problems.append(narrower)
        if noise is not None and rms_limit is not None and n_z >= rms_min_elements:
            result.rms_ratio = float(np.sqrt(z2_sum / n_z))
            if result.rms_ratio > rms_limit:
                problems.append(_systematic(result.rms_ratio, n_z, rms_limit))
        return _conclude(result, problems, g, tol, None if noise is None else (sigma, worst_part), rms_limit,
                         rms_min_elements)

    # Each test below has a fast form for the common case (every value finite, every tolerance,
    # golden value and sigma positive) that computes the same numbers without np.where and
    # fancy indexing, which cost ten passes over a large stage.
    problems = []
    finite = np.isfinite(v)
    all_finite = bool(finite.all())
    nonfinite = 0 if all_finite else int(np.count_nonzero(~finite & np.isfinite(g)))
    if nonfinite:
        problems.append(f"{nonfinite} NaN/inf value(s) where the golden is finite")
    result.nonfinite = nonfinite
    if not represent or dtype == "float64":  # every float64 value is representable in float64
        not_exact = 0
    else:
        not_exact = int(np.count_nonzero(~representable(v, dtype) if all_finite else finite & ~representable(v, dtype)))
    if not_exact:
        problems.append(
            f"{not_exact} of {v.size} values are not representable in {dtype}: computed or returned in a wider dtype"
        )
    narrower = narrower_precision(v, g, dtype) if value_checks else ""
    if narrower:
        problems.append(narrower)

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        err = np.subtract(v, g, out=_work("err", v.shape))
        np.abs(err, out=err)
        if not all_finite:  # the same infinity as the golden (lse = −inf where no key is visible): exact
            np.copyto(err, 0.0, where=(v == g))
        max_err = err.max()
        if np.isnan(max_err):  # NaN error (NaN or inf - inf): infinitely wrong
            np.copyto(err, np.inf, where=np.isnan(err))
            max_err = np.inf
        if tol.min() > 0:
            ratio = np.divide(err, tol, out=_work("ratio", v.shape))
        else:
            ratio = np.where(tol > 0, err / tol, np.where(err > 0, np.inf, 0.0))
        absolute = np.abs(g, out=_work("spare", v.shape))
        if absolute.min() > 0:
            rel_max = np.divide(err, absolute, out=absolute).max()
        else:
            rel_max = np.where(g != 0, err / absolute, np.where(err > 0, np.inf, 0.0)).max()
    worst = int(np.argmax(ratio))
    result.max_abs_err = float(max_err)
    result.max_rel_err = float(rel_max)
    result.worst_ratio = float(ratio.flat[worst])
    worst_flat = worst if compared is None else _nth_selected(compared, worst)
    result.worst_index = tuple(int(i) for i in np.unravel_index(worst_flat, golden.shape))
    if result.worst_ratio > 1:
        over = int(np.count_nonzero(ratio > 1))
        at = result.worst_index
        problems.append(
            f"{over} of {v.size} elements exceed the tolerance; worst at {at}: got {v.flat[worst]:.9g}, "
            f"expected {g.flat[worst]:.9g}, |error| {err.flat[worst]:.3g} > tolerance {tol.flat[worst]:.3g}"
        )
    if sigma is not None and worst_part is not None and rms_limit is not None:
        every = bool(sigma.min() > 0)
        positive = None if every else sigma > 0
        n_rms = sigma.size if every else int(np.count_nonzero(positive))
        if n_rms >= rms_min_elements:
            with np.errstate(over="ignore", invalid="ignore"):
                if every:
                    z = np.subtract(err, worst_part, out=_work("spare", v.shape))
                    np.maximum(z, 0.0, out=z)
                    z /= sigma
                else:
                    z = np.maximum(err[positive] - worst_part[positive], 0.0) / sigma[positive]
                result.rms_ratio = float(np.sqrt(np.mean(np.square(z, out=z))))
            if result.rms_ratio > rms_limit and result.worst_ratio <= 1:
                problems.append(_systematic(result.rms_ratio, n_rms, rms_limit))
    return _conclude(result, problems, g, tol, None if noise is None else (sigma, worst_part), rms_limit,
                     rms_min_elements)


def _nth_selected(mask: np.ndarray, n: int) -> int:
    """The flat index of ``mask``'s ``n``-th True element in C order (``np.flatnonzero(mask)[n]``), found
    by the count of each row (along the last axis) and one row's positions: not an index array of every
    compared element, where one is asked for."""
    rows = mask.reshape(-1, mask.shape[-1] if mask.ndim else 1)
    ends = np.cumsum(np.count_nonzero(rows, axis=1))
    row = int(np.searchsorted(ends, n, side="right"))
    before = int(ends[row - 1]) if row else 0
    return row * rows.shape[1] + int(np.flatnonzero(rows[row])[n - before])


def _compiled_loops() -> bool:
    """Whether a large case has brought the compiled loops into this process (:func:`_compiled_sweep`)."""
    from .engine import compiled  # (imports this module)

    return compiled.loaded_kernels() is not None


def _up_to(a: np.ndarray, keys: int) -> np.ndarray:
    """``a``'s first ``keys`` entries along its last (key) axis (a view; an axis of 1 is broadcast)."""
    return a[..., :keys] if a.shape[-1] > 1 else a


def _beyond(a: np.ndarray, keys: int) -> np.ndarray:
    """``a``'s entries from key ``keys`` on (a view; an axis of 1 is broadcast: all of it)."""
    return a[..., keys:] if a.shape[-1] > 1 else a


def _seen_keys_only(values: np.ndarray, golden: np.ndarray, tolerance: np.ndarray, visible: np.ndarray | None,
                    noise: tuple[np.ndarray, np.ndarray] | None, keys: int) -> tuple[Any, ...] | None:
    """(values, golden, tolerance, visible, noise) on the first ``keys`` keys when the entries beyond
    change nothing in :func:`compare_stage`'s result but its count; None otherwise.  With ``visible``
    (masked entries not compared): none beyond is visible.  Without (every entry compared, masked
    weights exactly 0): every value, golden value, tolerance and noise part beyond is 0 — an exact
    entry with a zero tolerance, whose ratio is 0 and which the root mean square leaves out."""
    if visible is not None:
        if np.any(_beyond(np.broadcast_to(visible, golden.shape), keys)):
            return None
    elif any(np.any(_beyond(a, keys)) for a in (values, golden, tolerance, *(noise or ()))):
        return None
    cut = None if noise is None else (_up_to(noise[0], keys), _up_to(noise[1], keys))
    return (_up_to(values, keys), _up_to(golden, keys), _up_to(tolerance, keys),
            None if visible is None else _up_to(np.broadcast_to(visible, golden.shape), keys), cut)


def _compiled_sweep(stage: str, values: np.ndarray, golden: np.ndarray, tolerance: np.ndarray,
                    visible: np.ndarray | None, noise: tuple[np.ndarray, np.ndarray] | None,
                    rms_limit: float | None, rms_min_elements: int, check_float32: bool) -> StageResult | None:
    """:func:`compare_stage`'s result for a large float64/float32 stage where nothing is out of the
    ordinary, by one compiled sweep without gathers (:func:`mhaspec.conformance.engine.compiled.ordinary_stage`)
    where a large case has brought the compiled loops into this process; None otherwise (the NumPy
    path then).  The same figures as the NumPy path (Σ z² summed in another order)."""
    from .engine import compiled  # (imports this module)

    kernels = compiled.loaded_kernels()
    if kernels is None:
        return None
    use_noise = noise is not None and rms_limit is not None
    found = compiled.ordinary_stage(kernels, values, golden, tolerance, noise if use_noise else None, visible,
                                    check_float32)
    if found is None:
        return None
    result = StageResult(stage, PASS, compared=found.compared)
    if found.compared == 0:
        result.message = "nothing to compare (every entry is masked)"
        return result
    result.max_abs_err, result.max_rel_err, result.worst_ratio = found.max_abs_err, found.max_rel_err, found.worst_ratio
    result.worst_index = tuple(int(i) for i in np.unravel_index(found.worst_flat, golden.shape))
    problems = []
    if use_noise and found.n_z >= rms_min_elements:
        assert rms_limit is not None
        result.rms_ratio = float(np.sqrt(found.z2 / found.n_z))
        if result.rms_ratio > rms_limit:
            problems.append(_systematic(result.rms_ratio, found.n_z, rms_limit))
    if problems:
        result.verdict = FAIL
        result.message = "; ".join(problems)
        return result
    if found.golden_above_tolerance:  # a zero result would fail: informative
        return result
    return None  # perhaps uninformative: the NumPy path decides, on the compared elements


def _systematic(rms: float, n: int, limit: float) -> str:
    return (f"systematic error: root-mean-square of error/sigma {rms:.3g} over {n} elements "
            f"exceeds {limit:.3g} (rounding noise stays below 0.58: the error is not rounding)")


def _conclude(result: StageResult, problems: list[str], g: np.ndarray, tol: np.ndarray,
              noise: tuple[np.ndarray, np.ndarray] | None, rms_limit: float | None,
              rms_min_elements: int) -> StageResult:
    """The verdict: fail with ``problems``, else uninformative where a zero result would pass."""
    if problems:
        result.verdict = FAIL
        result.message = "; ".join(problems)
    elif would_pass_zero(g, tol, noise, rms_limit, rms_min_elements):
        result.verdict = UNINFORMATIVE
        result.message = "a zero result would pass: the tolerance is at least |expected| at every element"
    return result


#: A stage of more elements than this is judged in chunks of this many elements (when nothing
#: in it is out of the ordinary): the chunk's intermediate results stay in the processor's cache,
#: where a whole large stage's would go to memory and back once per operation.
COMPARE_CHUNK = 1 << 16


def _chunks_of(shape: tuple[int, ...]) -> list[tuple[int, tuple[Any, ...]]]:
    """(flat offset, index) of consecutive blocks of about :data:`COMPARE_CHUNK` elements that
    cover an array of ``shape`` in C order (each index gives a view, never a copy)."""
    inner = 1
    axis = len(shape)
    while axis > 0 and inner * shape[axis - 1] <= COMPARE_CHUNK:
        axis -= 1
        inner *= shape[axis]
    if axis == 0:
        return [(0, ())]
    step = max(1, COMPARE_CHUNK // inner)
    out = []
    for lead in np.ndindex(*shape[: axis - 1]):
        base = int(np.ravel_multi_index(lead, shape[: axis - 1])) * shape[axis - 1] * inner if lead else 0
        for r in range(0, shape[axis - 1], step):
            out.append((base + r * inner, (*lead, slice(r, r + step))))
    return out


def _passing_in_chunks(v: np.ndarray, g: np.ndarray, tol: np.ndarray,
                       noise: tuple[np.ndarray, np.ndarray] | None,
                       dtype: str) -> tuple[float, float, float, int, float, int] | None:
    """(max |error|, max relative error, worst error/tolerance, its flat index, Σ z², elements with
    sigma > 0) of a stage where every value is finite and (unless ``dtype`` is float64)
    representable in ``dtype``, no tolerance, golden value or sigma is negative, every element
    with a zero tolerance is exact (masked attention weights), and no element exceeds its
    tolerance — computed chunk by chunk, the same numbers as :func:`compare_stage`'s whole-stage
    forms (Σ z² only summed in another order).  None as soon as a chunk is not so: the caller
    judges the whole stage, with every message.  (On one thread: shared among threads it
    measured slower.)"""
    max_err = rel_max = worst_ratio = z2 = 0.0
    worst_flat = n_z = 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for i, (offset, index) in enumerate(_chunks_of(v.shape)):
            vc, gc, tc = v[index], g[index], tol[index]
            if dtype != "float64" and not representable(vc, dtype).all():
                return None
            err = np.subtract(vc, gc, out=_work("c_err", vc.shape))
            np.abs(err, out=err)
            chunk_max = err.max()
            t_min = tc.min()
            if not np.isfinite(chunk_max) or not t_min >= 0:
                return None  # a NaN/inf value, or a negative (or NaN) tolerance
            ratio = np.divide(err, tc, out=_work("c_ratio", vc.shape))
            if not t_min > 0:  # zero tolerances (masked weights): the element must be exact, its ratio 0
                zero = tc == 0
                if err[zero].any():
                    return None
                np.copyto(ratio, 0.0, where=zero)
            at = int(np.argmax(ratio))
            r = float(ratio.flat[at])
            if r > 1:
                return None
            spare = np.abs(gc, out=_work("c_spare", vc.shape))
            if spare.min() > 0:
                rel = float(np.divide(err, spare, out=spare).max())
            else:  # a zero golden value: relative error 0 where exact, inf where not (as compare_stage)
                rel = _relative_max_with_zeros(err, spare)
            if noise is not None:
                sc, wc = noise[0][index], noise[1][index]
                s_min = sc.min()
                if not s_min >= 0:
                    return None
                z = np.subtract(err, wc, out=spare)
                np.maximum(z, 0.0, out=z)
                if s_min > 0:
                    z /= sc
                    n_z += z.size
                    z2 += float(np.square(z, out=z).sum())  # not np.dot: BLAS would wake its threads
                else:  # sigma 0 (masked weights): not in the root mean square, as in compare_stage
                    positive = sc > 0
                    zp = np.divide(z, sc, out=z, where=positive)[positive]  # the same quotients, one gather
                    n_z += zp.size
                    z2 += float(np.square(zp, out=zp).sum())
            max_err = max(max_err, float(chunk_max))
            rel_max = max(rel_max, rel)
            if r > worst_ratio or i == 0:
                worst_ratio, worst_flat = r, offset + at
    return max_err, rel_max, worst_ratio, worst_flat, z2, n_z


def _relative_max_with_zeros(err: np.ndarray, absolute: np.ndarray) -> float:
    """max of err/|golden| where |golden| (``absolute``, ≥ 0, overwritten) is positive, 0 where it is 0 and
    the element exact, inf where it is 0 and the element is not: ``np.where(absolute > 0, err / absolute,
    np.where(err > 0, inf, 0)).max()`` for finite ``err`` ≥ 0, without its three temporary arrays."""
    positive = absolute > 0
    rel = float(np.divide(err, absolute, out=absolute, where=positive).max())  # 0 where the golden is 0
    return math.inf if np.any(err[~positive]) else rel


def _head(shape: tuple[int, ...], elements: int = 4096) -> tuple[Any, ...]:
    """An index of about ``elements`` leading elements of an array of ``shape`` (its first rows along the
    second-to-last axis, at index 0 of the others): a view of a strided block, where ``.flat[:n]`` of one
    walks it element by element."""
    if len(shape) < 2:
        return (slice(0, elements),) if shape else ()
    return (0,) * (len(shape) - 2) + (slice(0, max(1, elements // max(shape[-1], 1))),)


def would_pass_zero(expected: np.ndarray, tol: np.ndarray, noise: tuple[np.ndarray, np.ndarray] | None,
                    rms_limit: float | None, rms_min_elements: int) -> bool:
    """True when an all-zero result would pass against ``expected`` (and ``expected`` is not all zero)."""
    head = _head(np.shape(expected))  # usually decided by the first elements: the rest is not read
    if np.size(expected) and np.any(np.abs(np.asarray(expected)[head]) > (
            tol if np.shape(tol) == np.shape(expected) else np.broadcast_to(tol, np.shape(expected)))[head]):
        return False
    absolute = np.abs(expected, out=_work("spare", np.shape(expected)))
    if not np.any(absolute > 0):
        return False
    if np.any(absolute > tol):
        return False
    if noise is not None and rms_limit is not None:
        sigma, worst = noise
        positive = sigma > 0
        if int(np.count_nonzero(positive)) >= rms_min_elements:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                z = np.maximum(absolute[positive] - worst[positive], 0.0) / sigma[positive]
                if float(np.sqrt(np.mean(np.square(z)))) > rms_limit:
                    return False
    return True


def fold_local(res: StageResult, local: StageResult, sources: tuple[str, ...]) -> None:
    """Fold a stage's local check (recomputed from the adapter's own ``sources``) into its golden
    check's result, in place: the stage fails if either fails; an uninformative golden check
    with a passing local check is a pass."""
    res.local_worst_ratio = local.worst_ratio
    golden_failed = res.verdict == FAIL
    if local.verdict == FAIL:
        text = f"local check (recomputed from its own {' and '.join(sources)}): {local.message}"
        res.message = f"{res.message}; {text}" if golden_failed else text
        res.failed_check = "golden+local" if golden_failed else "local"
        res.verdict = FAIL
    elif golden_failed:
        res.failed_check = "golden"
    elif res.verdict == UNINFORMATIVE and local.verdict == PASS:
        res.verdict = PASS
        res.message = ("the golden check cannot resolve this stage in this dtype (a zero result would pass); "
                       f"the local check from its own {' and '.join(sources)} passes")
