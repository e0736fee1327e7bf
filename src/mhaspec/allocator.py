"""How this process's C allocator (glibc malloc) treats freed memory.

The judge works one block of a case at a time, and every block allocates and frees the same
few-megabyte numpy temporaries.  By default glibc serves an allocation above its mmap threshold
(128 KiB, rising to at most 32 MiB as mmapped chunks are freed) with a fresh ``mmap`` and gives
it back to the system when it is freed, and it trims the heap's free top above 2× that threshold:
each block then page-faults all its temporaries in anew, which costs kernel time (at
T = S = 1024, float32: 1.5 s of system time in a 5 s run, 447,000 minor page faults).

:func:`keep_freed_pages` fixes the threshold at :data:`MMAP_THRESHOLD` and the trim threshold at
:data:`TRIM_THRESHOLD`, so that a block reuses the pages the previous block freed; arrays larger
than the threshold (a whole (B, H, T, S) stage of a large case) are still mmapped and returned
when freed.  :func:`release_freed_memory` gives the heap's free pages back at once (a worker
calls it after each reply, so that it does not hold the adapter's freed temporaries while the
runner judges).  Both do nothing where the C library is not glibc.

A worker's adapter makes whole-stage temporaries (at T = S = 4096, H = 8, float32: 512 MiB per
(B, H, T, S) array, a dozen of them in the numpy adapter's forward), so the worker raises both
thresholds (:data:`WORKER_MMAP_THRESHOLD`, :data:`WORKER_TRIM_THRESHOLD`) and asks numpy not to
advise huge pages (:func:`no_huge_page_advice`): with transparent huge pages on ``madvise``, every
fresh array of 4 MiB or more is faulted in as 2 MiB pages, which the kernel zeroes (and may compact
memory for) in system time.  Measured at T = S = 4096 (the numpy adapter's forward alone, one
process, load 4): 6.4 s user + 8.5 s system by default, 6.6 s + 1.8 s with both.
"""

from __future__ import annotations

import sys
from typing import Any

#: Allocations up to this size come from the heap and are reused once freed.
MMAP_THRESHOLD = 64 << 20
#: Free memory at the heap's top kept for reuse instead of trimmed.
TRIM_THRESHOLD = 256 << 20
#: A worker's thresholds: its adapter's whole-stage temporaries come from the heap and are reused
#: (mallopt takes an int: the trim threshold is the largest one).
WORKER_MMAP_THRESHOLD, WORKER_TRIM_THRESHOLD = 1 << 30, (1 << 31) - 1

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)

_LIBC: dict[str, Any] = {}


def _glibc() -> Any:
    if "libc" not in _LIBC:
        _LIBC["libc"] = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL(None)
                if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):  # glibc (musl has neither)
                    _LIBC["libc"] = libc
            except OSError:  # pragma: no cover - no C library to open
                pass
    return _LIBC["libc"]


def keep_freed_pages(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Make freed temporaries below ``mmap_threshold`` reusable, keeping up to ``trim_threshold`` free at
    the heap's top (see the module's docstring); True where it took effect."""
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD,
                                                                                        trim_threshold))


def no_huge_page_advice() -> bool:
    """Ask numpy not to ``madvise(MADV_HUGEPAGE)`` the arrays it allocates from now on (see the module's
    docstring); True where numpy has the switch (``numpy._core.multiarray._set_madvise_hugepage``)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    switch = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if switch is None:
        return False
    switch(False)
    return True


def release_freed_memory() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``): a worker calls it once
    a reply is sent, since the adapter's temporaries were freed but the allocator keeps them."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
