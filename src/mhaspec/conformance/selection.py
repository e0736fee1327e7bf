"""Which cases and dtypes a run judges: exact ids, ``-k`` patterns, dtype lists."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from ..errors import MhaspecError
from ..fixtures import GoldenSet
from ..spec import DTYPES
from ..spec.catalog import builtin_source


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


#: How many distinct reasons :func:`unsupported_hint` quotes.
REASONS_QUOTED = 3
#: How the reason of a case × dtype in a dtype the adapter does not declare begins.
DECLARED_DTYPES = "the adapter declares dtypes"


def unsupported_hint(reasons: Iterable[str], golden: str) -> str:
    """What a run whose every case × dtype was unsupported adds to "nothing was judged": the
    adapter's reasons and, unless the run was already on them or only its dtypes were refused, the
    built-in kernel-shaped cases."""
    distinct = list(dict.fromkeys(r for r in reasons if r))
    quoted = "; ".join(distinct[:REASONS_QUOTED]) + (f"; … {len(distinct) - REASONS_QUOTED} more"
                                                     if len(distinct) > REASONS_QUOTED else "")
    out = f" ({quoted})" if quoted else ""
    if golden != builtin_source("kernels") and not (distinct and all(r.startswith(DECLARED_DTYPES) for r in distinct)):
        out += ("; if your kernel needs kernel-shaped sizes (T = S a multiple of its block, head dim >= 16), "
                "try --catalog kernels")
    return out
