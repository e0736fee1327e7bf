"""Reports shared by the test modules: each variant's catalog run once per test session.

The two-sided proofs (test_tolerance_model, test_backward, test_deviations) judge the
same variants on the whole catalog; a report depends only on the adapter object and
the options, so one run serves them all.  They run the variants in this process
(``isolate=False``): what they prove is the verdicts, which do not depend on where the adapter
runs, and a worker per variant cost about a third of these modules' time (72 s -> 49 s).
tests/test_isolation.py checks that variants of every kind get the same report in a worker.
"""

from __future__ import annotations

from typing import Any

import mhaspec

_REPORTS: dict[tuple[int, str, bool], tuple[Any, Any]] = {}


def report_of(adapter: Any, precision: str = "standard", backward: bool = False) -> Any:
    """``mhaspec.check(adapter, timeout=None, precision=..., backward=..., isolate=False)``, run once
    per session."""
    key = (id(adapter), precision, backward)
    if key not in _REPORTS:  # the adapter is kept with its report: its id is never reused
        _REPORTS[key] = (adapter, mhaspec.check(adapter, timeout=None, precision=precision, backward=backward,
                                                isolate=False))
    return _REPORTS[key][1]
