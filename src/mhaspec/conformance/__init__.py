"""The verdict: run an adapter over the golden cases and judge every stage.

Entry points: :func:`check` (Python), ``mhaspec run`` (CLI) and the pytest
plugin (``pytest --pyargs mhaspec.conformance --mha-adapter=NAME``), all
judging through :class:`Session`.
"""

from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, PASS, StageResult, compare_stage
from .report import ERROR, UNSUPPORTED, CaseResult, Report
from .runner import DEFAULT_TIMEOUT, Session, check, select_cases
from .tolerance import stage_tolerances

__all__ = [
    "DEFAULT_TIMEOUT",
    "ERROR",
    "FAIL",
    "KNOWN_DEVIATION",
    "NOT_EXPOSED",
    "PASS",
    "UNSUPPORTED",
    "CaseResult",
    "Report",
    "Session",
    "StageResult",
    "check",
    "compare_stage",
    "select_cases",
    "stage_tolerances",
]
