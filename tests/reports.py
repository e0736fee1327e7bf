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

def judged_cases(adapter: Any) -> list[str]:
    """The catalog cases ``adapter`` is judged on: a case with a schedule only with ``decode(case)``, a packed case
    (``seq_lens``) only with ``packed = True`` — elsewhere they are ``unsupported`` (docs/serving.md); the decode,
    paged and packed zoos prove those cases (test_decode_proofs, test_paged_proofs, test_packed_proofs)."""
    decodes, packs = callable(getattr(adapter, "decode", None)), getattr(adapter, "packed", False) is True
    return [case_id for case_id in CATALOG.ids()
            if (CATALOG[case_id].schedule is None or decodes) and (CATALOG[case_id].seq_lens is None or packs)]


def report_of(adapter: Any, precision: str = "standard", backward: bool = False) -> Any:
    """``mhaspec.check(adapter, cases=judged_cases(adapter), timeout=None, precision=..., backward=...,
    isolate=False)``, run once per session."""
    key = (id(adapter), precision, backward)
    if key not in _REPORTS:  # the adapter is kept with its report: its id is never reused
        _REPORTS[key] = (adapter, mhaspec.check(adapter, cases=judged_cases(adapter), timeout=None,
                                                precision=precision, backward=backward, isolate=False))
    return _REPORTS[key][1]
