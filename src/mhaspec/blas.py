"""BLAS on one thread for a while (threadpoolctl), for the small products of the fast reference and
of the judge's chunk loops: a multi-threaded BLAS spends more CPU on waking and syncing its threads
than on their arithmetic.

``threadpool_limits`` looks for the loaded BLAS libraries at every call (it walks every shared
object the process has loaded: 1 ms with numba's); :func:`one_blas_thread` looks once, and again
only when a module has been imported since (which may have loaded another BLAS).  Only speed
depends on it: a product's result does not depend on the number of threads it may use here
(each call sets one).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

_FOUND: list[Any] = [None, -1]  # (threadpoolctl.ThreadpoolController, len(sys.modules) when it looked)
_LOCK = threading.Lock()


def one_blas_thread() -> Any:
    """A context in which BLAS runs on one thread (nothing where threadpoolctl is not installed)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - a dependency; only speed is lost without it
        return contextlib.nullcontext()
    with _LOCK:
        if _FOUND[0] is None or _FOUND[1] != len(sys.modules):
            _FOUND[:] = [ThreadpoolController(), len(sys.modules)]
        controller = _FOUND[0]
    return controller.limit(limits=1, user_api="blas")
