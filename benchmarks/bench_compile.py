"""Benchmark: what numba's compilation of the compiled chunk loops costs a process (CPU seconds).

A case above ``COMPILED_MIN_ELEMENTS`` takes the compiled loops (conformance/engine/kernels.py);
each process compiles them anew on their first calls (no cache on disk: numba's cache files are
pickles), each kernel for its one declared signature (``kernels.SIGNATURES``) with the helpers it
calls.  This prints the CPU seconds of importing numba and the kernels module, and of compiling
each kernel's signature, in a fresh process (the first one compiled also pays numba's own start); the sum is
what the compiled path costs a process before it saves anything (docs/tolerances.md, where the
threshold is derived from it).

    python benchmarks/bench_compile.py
"""

from __future__ import annotations

import time


def main() -> None:
    start = time.process_time()
    from mhaspec.conformance.engine import kernels

    imported = time.process_time() - start
    print(f"import numba and the kernels: {imported:.3f} s CPU")
    total = imported
    for name, signature in kernels.SIGNATURES.items():
        start = time.process_time()
        getattr(kernels, name).compile(signature)
        spent = time.process_time() - start
        total += spent
        print(f"compile {name:24s} {spent:.3f} s CPU")
    print(f"in all: {total:.3f} s CPU")


if __name__ == "__main__":
    main()
