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
from mhaspec.spec import CATALOG

_REPORTS: dict[tuple[int, str, bool], tuple[Any, Any]] = {}

#: The catalog's cases without a schedule: those an implementation without ``decode(case)`` is judged on
#: (a schedule case is ``unsupported`` there; the decode zoo proves the schedule cases: test_decode_proofs).
WITHOUT_SCHEDULE = [case_id for case_id in CATALOG.ids() if CATALOG[case_id].schedule is None]


def judged_cases(adapter: Any) -> list[str]:
    """The catalog cases ``adapter`` is judged on: every case with ``decode``, else :data:`WITHOUT_SCHEDULE`."""
    return CATALOG.ids() if callable(getattr(adapter, "decode", None)) else WITHOUT_SCHEDULE


def report_of(adapter: Any, precision: str = "standard", backward: bool = False) -> Any:
    """``mhaspec.check(adapter, cases=judged_cases(adapter), timeout=None, precision=..., backward=...,
    isolate=False)``, run once per session."""
    key = (id(adapter), precision, backward)
    if key not in _REPORTS:  # the adapter is kept with its report: its id is never reused
        _REPORTS[key] = (adapter, mhaspec.check(adapter, cases=judged_cases(adapter), timeout=None,
                                                precision=precision, backward=backward, isolate=False))
    return _REPORTS[key][1]
