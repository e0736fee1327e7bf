"""Benchmark: what the compiled chunk loops cost a process before they save anything (CPU seconds):
loading the library built with mhaspec (engine/native.py) against numba's compilation (engine/kernels.py).

A case above ``NATIVE_MIN_ELEMENTS`` takes the library's loops where it is built; else one above
``COMPILED_MIN_ELEMENTS`` takes numba's, which each process compiles anew on their first calls (no
cache on disk: numba's cache files are pickles), each kernel for its one declared signature
(``kernels.SIGNATURES``) with the helpers it calls.  This prints, in a fresh process, the CPU seconds
of loading the library (ctypes, the constants' check, each loop's argument types; mhaspec's own
modules, which a run has imported, before the clock), then of importing
numba and the kernels module and compiling each kernel's signature (the first one compiled also pays
numba's own start); the sums are what each path costs a process up front (docs/tolerances.md, where
the thresholds are derived from them).

    python benchmarks/bench_compile.py
"""

from __future__ import annotations

import time


def _library() -> None:
    start = time.process_time()
    try:
        from mhaspec.conformance.engine import native
    except ImportError as exc:
        print(f"the library: not loaded ({exc})")
        return
    spent = time.process_time() - start
    loops = [name for name in native.SIGNATURES if getattr(native, name) is not None]
    print(f"load the library (ctypes, {len(loops)} loops: {', '.join(loops)}): {spent * 1e3:.1f} ms CPU")


def _numba() -> None:
    start = time.process_time()
    try:
        from mhaspec.conformance.engine import kernels
    except ImportError as exc:
        print(f"numba: not installed ({exc})")
        return
    imported = time.process_time() - start
    print(f"import numba and the kernels: {imported:.3f} s CPU")
    total = imported
    for name, signature in kernels.SIGNATURES.items():
        start = time.process_time()
        getattr(kernels, name).compile(signature)
        spent = time.process_time() - start
        total += spent
        print(f"compile {name:24s} {spent:.3f} s CPU")
    print(f"numba in all: {total:.3f} s CPU")


def main() -> None:
    from mhaspec.conformance.engine import compiled  # noqa: F401 (a run has imported it: not counted)

    _library()
    _numba()


if __name__ == "__main__":
    main()
