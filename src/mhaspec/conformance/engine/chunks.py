"""The chunk loops: a (B·H, T, S) stage split into chunks of heads × query rows, shared among
threads, with BLAS on one thread inside them.

Every (B, H, T, S) rule of the model is element-wise or per query row, so a chunk's bounds are
the whole stage's (only the order of the bounds' own float64 roundings, and of the float32
products', depends on the chunk shape).  A chunk's work then stays in the processor's cache.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ... import blas
from ..compare import Scratch

#: Elements of the (B, H, T, S) stages handled at once by the NumPy chunk loops: their
#: element-wise work then stays in the processor's cache (a whole stage of a large case does not).
CHUNK_ELEMENTS = 1 << 16

#: Threads of the chunk loops of a large case (at most; never more than the CPUs this process
#: may use).  NumPy and BLAS release the GIL in each operation, and the chunks write disjoint
#: slices, so the bounds do not depend on the number of threads.
MAX_THREADS = 4

#: A case with fewer chunks than this runs them on the calling thread.
THREADED_MIN_CHUNKS = 16


def one_blas_thread() -> Any:
    """A context in which BLAS runs on one thread (threadpoolctl), for the chunk loops.

    Their products are small ((rows × D) @ (D × S)); a multi-threaded BLAS spends more on
    waking and syncing its threads than on the arithmetic, and on a busy machine (tox -p, a
    loaded CI runner) its spinning threads made the loop ten times slower (docs/tolerances.md)."""
    return blas.one_blas_thread()


def threads() -> int:
    """How many threads the chunk loops of a large case use: :data:`MAX_THREADS` at most."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus))


def each_chunk(N: int, T: int, S: int, fn: Any, elements: int | None = None) -> None:
    """``fn(heads, rows, scratch)`` on every chunk (:func:`chunks`, of about ``elements``, by default
    :data:`CHUNK_ELEMENTS`).  Many chunks: BLAS on one thread, the chunks shared among
    :func:`threads` threads, each with its own work arrays."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    parts = chunks(N, T, S, elements)
    n_threads = threads() if len(parts) >= max(2, THREADED_MIN_CHUNKS * CHUNK_ELEMENTS // elements) else 1
    if n_threads == 1:
        scratch = Scratch()
        with one_blas_thread() if len(parts) > 8 else contextlib.nullcontext():
            for n, r in parts:
                fn(n, r, scratch)
        return

    state = np.geterr()  # the caller's floating-point error handling: a thread does not inherit it

    def share(part: list[tuple[slice, slice]]) -> None:
        scratch = Scratch()
        with np.errstate(**state):
            for n, r in part:
                fn(n, r, scratch)

    step = -(-len(parts) // n_threads)
    with one_blas_thread(), ThreadPoolExecutor(n_threads) as pool:
        for future in [pool.submit(share, parts[i:i + step]) for i in range(0, len(parts), step)]:
            future.result()


def chunks(N: int, T: int, S: int, elements: int | None = None) -> list[tuple[slice, slice]]:
    """(head slice, query-row slice) of each chunk of a (N, T, S) array, N = B·H, of about
    ``elements`` (by default :data:`CHUNK_ELEMENTS`)."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    if T * S <= elements:
        step = max(1, elements // max(T * S, 1))
        return [(slice(n, min(N, n + step)), slice(None)) for n in range(0, N, step)]
    rows = max(1, elements // max(S, 1))
    return [(slice(n, n + 1), slice(t, min(T, t + rows))) for n in range(N) for t in range(0, T, rows)]
