"""The verdict: run an adapter over the golden cases and judge every stage.

Entry points: :func:`check` (Python), ``mhaspec run`` (CLI) and the pytest
plugin (``pytest --pyargs mhaspec.conformance --mha-adapter=NAME``), all
judging through :class:`Session`.

Names are imported on first use, so that the adapter's worker process
(:mod:`mhaspec.protocol.worker`) starts without loading the judging code.
"""

from __future__ import annotations

import importlib
from typing import Any


_EXPORTS = {
    "FAIL": "compare", "KNOWN_DEVIATION": "compare", "NOT_EXPOSED": "compare", "PASS": "compare",
    "UNINFORMATIVE": "compare",
    "StageResult": "compare", "compare_stage": "compare",
    "ERROR": "report", "UNSUPPORTED": "report", "CaseResult": "report", "Report": "report",
    "DEFAULT_TIMEOUT": "runner", "Session": "runner", "check": "runner", "select_cases": "runner",
    "stage_tolerances": "tolerance",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
