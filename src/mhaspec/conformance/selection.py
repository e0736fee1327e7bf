"""Which cases and dtypes a run judges: exact ids, ``-k`` patterns, dtype lists."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from ..errors import MhaspecError
from ..fixtures import GoldenSet
from ..spec import DTYPES


def select_cases(golden: GoldenSet, cases: Iterable[str] | None = None, pattern: str | None = None) -> list[str]:
    """Case ids to run: ``cases`` (exact ids) and/or ``pattern`` (comma-separated
    substrings or shell patterns, like pytest's -k on names)."""
    ids = golden.ids()
    if cases is not None:
        cases = list(cases)
        unknown = [c for c in cases if c not in ids]
        if unknown:
            raise MhaspecError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(ids)}")
        ids = [c for c in ids if c in cases]
    if pattern:
        alternatives = [p.strip() for p in pattern.split(",") if p.strip()]

        def hit(case_id: str) -> bool:
            return any(
                fnmatch.fnmatchcase(case_id, p) if any(ch in p for ch in "*?[") else p in case_id
                for p in alternatives
            )

        ids = [c for c in ids if hit(c)]
        if not ids:
            raise MhaspecError(f"no case matches -k {pattern!r}; cases: {', '.join(golden.ids())}")
    return ids


def resolve_dtypes(dtypes: Iterable[str] | str | None) -> list[str]:
    """The dtypes to run, in :data:`~mhaspec.spec.DTYPES` order: all of them (None), or those
    named (a list, or a comma-separated string)."""
    if dtypes is None:
        return list(DTYPES)
    if isinstance(dtypes, str):
        dtypes = [d.strip() for d in dtypes.split(",") if d.strip()]
    dtypes = list(dtypes)
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise MhaspecError(f"unknown dtype(s) {', '.join(unknown)}; dtypes are {', '.join(DTYPES)}")
    return [d for d in DTYPES if d in dtypes]
