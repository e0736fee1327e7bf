"""The compiled chunk loops built with mhaspec (the C extension ``_loops``, compiled at install time):
the loops of :mod:`.kernels` without numba's compilation in every process.

The library (``csrc/*.c``, built by ``pip install`` where a C compiler is found; optional: without one the
install goes on, and the numba loops or the NumPy ones judge, with the same verdicts) is loaded here with
ctypes, and each loop is called by the name and with the arguments of :mod:`.kernels`'s (:func:`call`), so
that :mod:`.compiled` takes either.  Each array travels as its pointer, its lengths and its strides in
elements (``csrc/common.h``, ARR3/ARR2); an array a loop reads row by row must have a unit last stride (a
read-only one is copied where it has not; a written one raises :class:`NativeError`).  Nothing is pickled: only
pointers and numbers cross.

``import mhaspec`` never loads the library: :func:`mhaspec.conformance.engine.compiled.kernels_for_shape` imports
this module only for a large case.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import Any, Callable

import numpy as np

from ..model.softmax import SECOND_ORDER_CLOSED_FORM
from ..model.vocabulary import LAMBDA, U64

#: The library's module name (an extension module with no functions of its own: csrc/module.c).
LIBRARY = f"{__package__}._loops"

#: exp(a)·exp(b)·EXP_PRODUCT >= exp(a + b), as in the library (csrc/common.h) and :mod:`.kernels`.
EXP_PRODUCT = 1 + 2.0**-49


class NativeError(RuntimeError):
    """An argument the compiled loop cannot take (a written array of another dtype or strides)."""


#: What a call that cannot be made raises: the caller then switches to the NumPy loops (same bounds).
ERRORS = (NativeError,)


def _load() -> ctypes.CDLL:
    spec = importlib.util.find_spec(LIBRARY)
    if spec is None or spec.origin is None:
        raise ImportError(f"{LIBRARY} is not built (no C compiler at install time)")
    lib = ctypes.CDLL(spec.origin)
    if not hasattr(lib, "mh_constants") or not hasattr(lib, "mh_cpu_level"):
        raise ImportError(f"{spec.origin} is a build from another mhaspec (no per-level loops); reinstall mhaspec")
    expected = (LAMBDA, U64, SECOND_ORDER_CLOSED_FORM, EXP_PRODUCT)
    got = (ctypes.c_double * len(expected))()
    lib.mh_constants.restype = ctypes.c_int64
    n = lib.mh_constants(got, ctypes.c_int64(len(expected)))
    if n != len(expected) or tuple(got) != expected:
        raise ImportError(f"{spec.origin} was built with other constants than this mhaspec's model "
                          f"({tuple(got)} != {expected}): a stale build; reinstall mhaspec")
    return lib


_LIB = _load()

#: The x86-64 levels of the loops' builds (csrc/common.h, MH_LEVEL), lowest first, with mh_cpu_level's number.
LEVELS: dict[str, int] = {"base": 0, "v3": 3, "v4": 4}


def _cpu_level() -> int:
    """mh_cpu_level's number (csrc/module.c): the highest of :data:`LEVELS` this processor runs."""
    _LIB.mh_cpu_level.restype = ctypes.c_int64
    return int(_LIB.mh_cpu_level())


def supported_levels() -> tuple[str, ...]:
    """The levels this processor runs, lowest first (a test runs every loop at each)."""
    top = _cpu_level()
    return tuple(name for name, number in LEVELS.items() if number <= top)


def chosen_level(environ: Any = os.environ) -> str:
    """The level this process's loops run at: the processor's highest, or the lower one that
    ``MHASPEC_LOOPS_LEVEL`` names (``base``, ``v3``; a testing aid: the AVX2 or baseline build on an AVX-512
    machine, with the verdicts unchanged).  A level above the processor's is refused (its code would fault)."""
    wanted = environ.get("MHASPEC_LOOPS_LEVEL", "")
    levels = supported_levels()
    if not wanted:
        return levels[-1]
    if wanted not in LEVELS:
        raise ImportError(f"MHASPEC_LOOPS_LEVEL={wanted!r}: not one of {', '.join(LEVELS)}")
    if wanted not in levels:
        raise ImportError(f"MHASPEC_LOOPS_LEVEL={wanted!r}: this processor runs only {', '.join(levels)}")
    return wanted


#: The level bound below, once per process.
LEVEL = chosen_level()


def _symbol(name: str, level: str) -> Any:
    """The C function of loop ``name`` at ``level`` (``mh_<name>_<level>``), or None where the library lacks it."""
    return getattr(_LIB, f"mh_{name}_{level}", None)


#: Each loop's arguments, in :mod:`.kernels`' order: an array as ``dtype/ndim`` and ``r`` (read row by row:
#: unit last stride, copied where it has not), ``w`` (written: unit last stride and the dtype, or
#: :class:`NativeError`) or ``a`` (read with any strides, a broadcast view too); ``f8`` a float, ``b1`` a
#: flag, ``i8`` an integer.  The C function is ``mh_<name>_<level>``, each array as pointer, lengths and strides
#: (ARR3/ARR2), returning an int64 (nonzero: every value finite), or, for those in :data:`RESULTS`, writing that many
#: float64s into a last pointer argument.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "attention_chunk": ("f8/3w", "f8/3w", "b1/3a", "f4/3r", "f4/3r", *("f8",) * 10,
                        "b1", "f8/3w", "f8/3w", "f8/3w", "f8/3w",
                        "b1", "b1", "f8/3a", "f8", "f8/3a", "f8", "f8/3w", "f8/3w",
                        "f8/3w", "f8/3w", "f4/3w", "f4/3w", "f8/2w", "f8/2w", "i8"),
    "local_weights_chunk": ("f8/3r", "b1/3a", *("f8",) * 5, "f8/3w", "f8/3w", "f8/3w", "f8/2w", "i8"),
    # local_weights_chunk, and each row's local lse operands into a last (heads, rows, 7) array (no numba
    # counterpart: csrc/local.c, compiled.local_weights)
    "local_weights_lse_chunk": ("f8/3r", "b1/3a", *("f8",) * 5, "f8/3w", "f8/3w", "f8/3w", "f8/2w", "i8", "f8/3w"),
    "local_scores_chunk": ("f8/3w", "f4/3r", "f4/3r", *("f8",) * 6, "f8/3w", "f8/3w", "i8"),
    "local_outputs_operands": ("f8/3r", "f4/3w", "f4/3w"),
    "ordinary_stage": (*("f8/3a",) * 5, "u1/3a", "b1", "b1", "b1"),
    "sum_squares": ("f8/3a", "f8/3a", "u1/3a", "b1", "b1"),
    "sum_squares_f4": ("f4/3a", "f8/3a", "u1/3a", "b1", "b1"),
}

# attention_chunk, and each row's golden lse operands into a last (heads, rows, 5) array (no numba counterpart:
# csrc/attention_rows.h, compiled.attention_chunk)
SIGNATURES["attention_lse_chunk"] = (*SIGNATURES["attention_chunk"], "f8/3w")

#: The loops that return a tuple: (float64s written, how each is returned).
RESULTS: dict[str, tuple[type, ...]] = {
    "ordinary_stage": (bool, int, float, float, float, int, float, int, bool),
    "sum_squares": (float,),
    "sum_squares_f4": (float,),
}

_DTYPES = {"f8": np.float64, "f4": np.float32, "b1": np.bool_, "u1": np.uint8}
_CTYPES = {"f8": ctypes.c_double, "b1": ctypes.c_int64, "i8": ctypes.c_int64}


def _argtypes(kinds: tuple[str, ...], results: int) -> list[Any]:
    types: list[Any] = []
    for kind in kinds:
        if "/" in kind:
            types += [ctypes.c_void_p] + [ctypes.c_int64] * (2 * int(kind.split("/")[1][0]))
        else:
            types.append(_CTYPES[kind])
    return types + ([ctypes.c_void_p] if results else [])


def _array(a: Any, kind: str, name: str, position: int) -> list[Any]:
    """The argument ``a`` of kind ``kind`` (:data:`SIGNATURES`) as the array held through the call, its
    pointer, its lengths and its strides in elements (csrc/common.h, ARR3/ARR2)."""
    code, rest = kind.split("/")
    ndim, mode = int(rest[0]), rest[1]
    dtype = _DTYPES[code]
    a = np.asarray(a)
    if a.ndim != ndim:
        raise NativeError(f"{name}: argument {position} has {a.ndim} axes, not {ndim}")
    if mode == "w":
        if a.dtype != dtype or (a.shape[-1] > 1 and a.strides[-1] != a.itemsize) or not a.flags.writeable:
            raise NativeError(f"{name}: argument {position} must be a writeable {np.dtype(dtype).name} array "
                              f"with a unit last stride (got {a.dtype}, strides {a.strides})")
    elif a.dtype != dtype or (mode == "r" and a.shape[-1] > 1 and a.strides[-1] != a.itemsize):
        a = np.ascontiguousarray(a, dtype=dtype)
    strides = [s // a.itemsize if n > 1 else 0 for s, n in zip(a.strides, a.shape)]
    return [a, a.ctypes.data, *a.shape, *strides]


def _kernel(name: str, level: str = LEVEL) -> Callable[..., Any]:
    """The loop ``name`` at ``level`` with :mod:`.kernels`' arguments (the library has it: :func:`lacking`)."""
    kinds = SIGNATURES[name]
    results = RESULTS.get(name, ())
    fn = _symbol(name, level)
    fn.argtypes = _argtypes(kinds, len(results))
    fn.restype = ctypes.c_int64

    def loop(*args: Any) -> Any:
        if len(args) != len(kinds):
            raise NativeError(f"{name}: {len(args)} arguments, not {len(kinds)}")
        held, flat = [], []  # held: the arrays (and copies) alive until the call returns
        for position, (a, kind) in enumerate(zip(args, kinds)):
            if "/" in kind:
                array, *pointer_and_strides = _array(a, kind, name, position)
                held.append(array)
                flat += pointer_and_strides
            else:
                flat.append(float(a) if kind == "f8" else int(a))
        if not results:
            return bool(fn(*flat))
        out = np.zeros(len(results))
        fn(*flat, out.ctypes.data)
        return tuple(kind(x) for kind, x in zip(results, out))

    loop.__name__ = loop.__qualname__ = name
    loop.__doc__ = f"The compiled ``{name}`` of :mod:`.kernels` (csrc: ``mh_{name}_{level}``)."
    return loop


def lacking(names: Any, level: str = LEVEL) -> list[str]:
    """The loops of ``names`` that the library has no C function for at ``level`` (:func:`_symbol`)."""
    return [name for name in names if _symbol(name, level) is None]


if lacking(SIGNATURES):  # a library built from another mhaspec: refused whole, as one with other constants
    raise ImportError(f"{LIBRARY} has no loop {', '.join(lacking(SIGNATURES))}: a stale build; "
                      f"reinstall mhaspec")

attention_chunk = _kernel("attention_chunk")
attention_lse_chunk = _kernel("attention_lse_chunk")
local_weights_chunk = _kernel("local_weights_chunk")
local_weights_lse_chunk = _kernel("local_weights_lse_chunk")
local_scores_chunk = _kernel("local_scores_chunk")
local_outputs_operands = _kernel("local_outputs_operands")
ordinary_stage = _kernel("ordinary_stage")
sum_squares = _kernel("sum_squares")
sum_squares_f4 = _kernel("sum_squares_f4")


def call(name: str, *args: Any) -> Any:
    """The loop ``name`` with :mod:`.kernels`' arguments (looked up here, so that a test can replace it)."""
    return globals()[name](*args)


def _exp_array(x: np.ndarray, level: str = LEVEL) -> np.ndarray:
    """The library's exponential (csrc/common.h mh_exp) of each float64 of ``x``, at ``level``: for the tests."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    out = np.empty_like(x)
    _symbol("exp_array", level)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                ctypes.c_int64(x.size))
    return out


def _exp(x: float, level: str = LEVEL) -> float:
    """The library's exponential (csrc/common.h mh_exp) of one float64: for the tests."""
    return float(_exp_array(np.array([x]), level)[0])


def _others_sum(a: np.ndarray, S: int) -> tuple[float, float]:
    """The library's (Σ_{k≠j} a_k for the row's largest a_j, that term) (csrc/common.h mh_others_sum)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    out = np.empty(2)
    _LIB.mh_others_sum_row(a.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(S), out.ctypes.data_as(ctypes.c_void_p))
    return float(out[0]), float(out[1])
