"""Which (variant, case) pairs a bug actually changes: the float64 run differs from the golden.

A bug that leaves the float64 result unchanged on a case (a causal off-by-one on a
case without causal masking, dropping b_o where there is no bias) cannot be caught
there in any dtype; the per-dtype detection rate is taken over the pairs it changes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mhaspec.fixtures import GoldenSet
from mhaspec.spec import DTYPES

#: relative difference (to the stage's largest golden magnitude) that counts as a change
CHANGED = 1e-9


@lru_cache(maxsize=1)
def golden_set() -> GoldenSet:
    return GoldenSet()


def changes_float64_result(adapter, golden_case) -> bool:
    """True if ``adapter`` run in float64 differs from the golden on a stage it returns."""
    try:
        returned = adapter.run(golden_case.case("float64"))
    except Exception:
        return True  # it crashes: visible (and reported as an error)
    for stage, value in returned.items():
        got = np.asarray(value, dtype=np.float64)
        want = golden_case.stages[stage]
        if got.shape != want.shape:
            return True
        with np.errstate(invalid="ignore"):
            diff = np.abs(got - want)
        if not np.all(np.isfinite(diff) | ~np.isfinite(want)):
            return True
        if np.nanmax(diff, initial=0.0) > CHANGED * (np.max(np.abs(want), initial=0.0) + 1e-300):
            return True
    return False


def applies(adapter, dtype: str) -> bool:
    """Whether the variant is a bug in ``dtype`` at all: computing in float16 is only a bug
    when a wider dtype was asked for (DTYPES runs from the widest to the narrowest)."""
    compute = getattr(adapter, "compute_dtype", None)
    return compute is None or DTYPES.index(dtype) < DTYPES.index(compute)


def visible_cases(adapter) -> set[str]:
    """The case ids where ``adapter``'s float64 result differs from the golden."""
    gs = golden_set()
    return {cid for cid in gs.ids() if changes_float64_result(adapter, gs.load(cid))}


visible_triples = visible_cases
