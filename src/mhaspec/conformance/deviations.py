"""An adapter's declared deviations, applied to its failing stages (docs/adapters.md "Known deviations").

A declaration (:class:`~mhaspec.protocol.contract.Deviation`) names the cases, dtypes and
stages it covers.  A failing stage it covers becomes a ``known deviation`` — unless it is
row-scoped (``rows="fully_masked"``) and the stage fails outside the query rows that see no
key too, or bounded (``within=``) and the stage fails the tolerances it names too: then the
failure stays a failure, a bug the deviation cannot account for.  After a run, a declaration
that matches no case, that names only stages the adapter never returned, or that covered only
passing stages, is a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..protocol.contract import Deviation, match_pattern
from ..spec import BACKWARD_STAGES, CATALOG, INPUT_GRADIENTS, REGISTRY, STAGES
from .compare import FAIL, KNOWN_DEVIATION, StageResult, as_float_array, compare_stage, fold_local, worst_check_ratio


def outside_blind_rows(golden: GoldenCase, stage: str) -> np.ndarray | None:
    """Boolean selection (stage shape) of the elements *not* in a query row that sees no key,
    or None for a stage without a query-row axis (the projections of key and value); none
    (all False) for a gradient without a query-row axis, to which every query row contributes —
    all True if the case has no such row (nothing to excuse)."""
    st = REGISTRY[stage]
    if not st.attends:
        return None
    blind = ~golden.visible.any(axis=-1)  # (B, H, T)
    shape = golden.stages[stage].shape
    summed = INPUT_GRADIENTS[golden.spec.inputs].get(stage, "")  # d_query of self-attention holds d_key, d_value
    if st.rows is None or "k" in summed or "v" in summed:  # every element sums over every query row, if any
        return np.full(shape, not blind.any())
    if st.head_axis_first:  # (B, H, T, ·), or (B, H, T): lse
        return np.broadcast_to(~blind if len(shape) == blind.ndim else ~blind[..., None], shape)
    return np.broadcast_to(~blind.any(axis=1)[..., None], shape)  # (B, T, ·)


def within_absolute(bound: float, stage: str, got: Any, expected: np.ndarray, tolerance: np.ndarray, dtype: str,
                    selected: np.ndarray | None, local: tuple[np.ndarray, np.ndarray, tuple[str, ...]] | None = None,
                    ) -> StageResult:
    """``stage`` against the golden (``expected``, ``tolerance``) and, with ``local`` (its reference,
    tolerance and sources), its local check, every element within its tolerance or ``|error| <= bound``:
    what an absolute ``within`` allows."""
    res = compare_stage(stage, got, expected, np.maximum(tolerance, bound), dtype, selected)
    if local is not None:
        ref, tol, sources = local
        fold_local(res, compare_stage(stage, got, ref, np.maximum(tol, bound), dtype, selected, value_checks=False),
                   sources)
    return res


def _beyond_absolute(bound: float, got: Any, golden: GoldenCase, stage: str, selected: np.ndarray | None,
                     judge: Callable[[np.ndarray | None], StageResult]) -> StageResult | None:
    """The elements of ``stage`` (of ``selected``) whose |error| exceeds an absolute ``bound``, judged
    as normal — golden, local, systematic and value checks — or None when ``got`` is no array of the
    stage's shape (the widened check has failed it already)."""
    values, _ = (None, "") if got is None else as_float_array(got)
    expected = golden.stages[stage]
    if values is None or values.shape != expected.shape:
        return None
    with np.errstate(invalid="ignore"):
        beyond = ~(np.abs(values - expected) <= bound)  # NaN and inf errors are beyond it
    return judge(beyond if selected is None else beyond & selected)


class DeclaredDeviations:
    """The deviations an adapter declares, and which of them this run has used."""

    def __init__(self, declared: Iterable[Deviation]) -> None:
        self.declared = list(declared)
        self._used: set[int] = set()  # indices of deviations that excused a failing stage
        self._passed_matching: set[int] = set()  # … that covered a stage which passed
        self._returned: set[str] = set()  # the stages the adapter returned in this run

    def apply(
        self,
        res: StageResult,
        golden: GoldenCase,
        dtype: str,
        visible: np.ndarray | None,
        judge: Callable[[np.ndarray | None], StageResult],
        judge_within: Callable[[str | float, np.ndarray | None], StageResult],
        got: Any = None,
    ) -> None:
        """Turn a failing ``res`` into a known deviation when the first applicable declaration excuses it.

        A row-scoped declaration applies only where the case has rows that see
        no key, and excuses the failure only if ``judge`` passes everything
        outside those rows.  A bounded one (``within``) excuses it only if
        ``judge_within`` passes the stage with the tolerances it names: an
        error beyond them is a bug the deviation cannot account for.  An
        absolute bound (a number) also needs ``got``, the adapter's stage: the
        elements whose error exceeds it must pass ``judge``, every check.
        """
        self._returned.add(res.stage)
        beyond = ""
        for i, dev in enumerate(self.declared):
            if not dev.matches(golden.id, dtype, res.stage):
                continue
            outside = None
            if dev.rows == "fully_masked":
                outside = outside_blind_rows(golden, res.stage)
                if outside is None or outside.all():
                    continue  # this case has no such rows, or the stage has no query-row axis
            if res.verdict != FAIL:
                self._passed_matching.add(i)
                return
            if dev.within is not None:
                # rows that a row-scoped declaration of this stage excuses are left to it (a uniform row
                # and a float32 scale, say, in the same case): the bound holds for everything else
                selected, rows_excused = visible, ""
                if any(o.rows == "fully_masked" and o.matches(golden.id, dtype, res.stage) for o in self.declared):
                    outside_rows = outside_blind_rows(golden, res.stage)
                    if outside_rows is not None and not outside_rows.all():
                        selected = outside_rows if visible is None else outside_rows & visible
                        rows_excused = "; the query rows that see no key are left to its row-scoped declaration"
                bounded = judge_within(dev.within, selected)
                ratio = worst_check_ratio(bounded)
                if isinstance(dev.within, str):
                    what = "the worst-case contract" if dev.within == "worst-case" else f"{dev.within} tolerances"
                else:
                    what = f"its tolerances or |error| ≤ {dev.within:g}"
                    rest = None if bounded.verdict == FAIL else _beyond_absolute(dev.within, got, golden, res.stage,
                                                                                selected, judge)
                    if rest is not None:  # its ratios are the widened bound's there (|error| > within)
                        ratio = max((x for x in (ratio, worst_check_ratio(rest)) if x is not None), default=None)
                        if rest.verdict == FAIL:
                            bounded, ratio = rest, worst_check_ratio(rest)
                if bounded.verdict == FAIL:
                    shown = "" if ratio is None else f", worst ratio {ratio:.3g}"
                    beyond = (f"; beyond its declared deviation ({dev.pattern}): fails {what} too{shown} — "
                              f"a bug the deviation cannot account for")
                    continue
                res.within, res.within_ratio = dev.within, ratio
                if ratio is not None:
                    res.message += f"; within its declared bound ({what}): worst ratio {ratio:.3g}"
                res.message += rows_excused  # (within and rows never combine: outside is None here)
            if outside is not None:
                rest = judge(outside if visible is None else outside & visible)
                if rest.verdict == FAIL:
                    continue  # it fails outside those rows too: a real failure
                if rest.worst_ratio is None and rest.compared == 0 and REGISTRY[res.stage].direction == "backward":
                    res.message += "; every element of this gradient sums over the query rows that see no key"
                elif rest.worst_ratio is None:  # every row sees no key: nothing outside them to compare
                    res.message += "; every query row here sees no key"
                else:
                    res.message += (f"; outside the query rows that see no key every element passes "
                                    f"(worst ratio {rest.worst_ratio:.3g})")
            res.verdict, res.reason = KNOWN_DEVIATION, dev.reason
            self._used.add(i)
            return
        res.message += beyond

    def warnings(self, golden_ids: Iterable[str]) -> list[str]:
        """Declared deviations that match no case (of ``golden_ids`` or the catalog), that name only
        stages the adapter never returned in this run, or that never occurred in this run."""
        out = []
        # a case of the built-in catalog is a case too: an adapter's deviations name them, and a user's own
        # golden folder or --catalog need not hold them
        known = list(golden_ids) + [c.id for c in CATALOG]
        for i, dev in enumerate(self.declared):
            never = self._never_returned(dev)
            if not any(match_pattern(c, dev.case) for c in known):
                out.append(f"known deviation {dev.pattern} matches no case in the golden folder or the catalog")
            elif never:
                out.append(f"known deviation {dev.pattern} can apply to nothing: the adapter never returned the "
                           f"stage(s) it names ({', '.join(never)}) in this run")
            elif i in self._passed_matching and i not in self._used:
                out.append(f"known deviation {dev.pattern} did not occur: every stage it covers passed")
        return out

    def _never_returned(self, dev: Deviation) -> list[str]:
        """The stages ``dev`` names, when the adapter returned none of them in this run (its backward
        stages only if it returned any: a run without --backward has none); [] otherwise, or when the
        adapter returned nothing at all (nothing judged: the report says so)."""
        if not self._returned or any(match_pattern(s, dev.stage) for s in self._returned):
            return []
        backward = any(s in BACKWARD_STAGES for s in self._returned)
        return [s for s in (*STAGES, *(BACKWARD_STAGES if backward else ())) if match_pattern(s, dev.stage)]

