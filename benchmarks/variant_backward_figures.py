"""Benchmark: the two-sided proof of the attention variants' backward, per dtype (issue 31, backward).

Prints, for each bug of the variants' backward kill list (tests/backward_variant_zoo.py: KILL_LIST),
every stage exposed and as ``loss.backward()`` shows it (output and the leaves' gradients), the
case×dtype it is rejected in at its first changed backward stage among those where it changes the
float64 result, and the share per dtype; for each correct implementation (CORRECT, under its precision
contract) its passing case×dtype and smallest margin (tolerance / error at the worst element) per dtype,
on the catalog's variant cases.

    PYTHONPATH=src python benchmarks/variant_backward_figures.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import FAIL, PASS  # noqa: E402
from mhaspec.conformance.compare import UNINFORMATIVE  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.backward_variant_zoo import CORRECT, KILL_LIST  # noqa: E402
from tests.test_variant_backward_proofs import (  # noqa: E402
    NOT_IN_THE_CATALOG,
    VIEWS,
    adapter_of,
    caught_at,
    expected_backward_stages,
    first_changed_backward_stage,
)
from tests.variant_cases import variant_golden, variant_report  # noqa: E402


def kill_list_figures(precision: str) -> None:
    """Per bug and view: caught at its first changed stage / caught at all, per dtype."""
    totals = {(view, d): [0, 0, 0] for view in VIEWS for d in DTYPES}  # at its stage, caught, changed
    for name in KILL_LIST:
        for view in VIEWS:
            start = time.perf_counter()
            adapter = adapter_of(name, view)
            expected = expected_backward_stages(adapter)
            missed, wrong = caught_at(variant_report(adapter, precision, backward=True), expected)
            cells = []
            for d in DTYPES:
                caught = len(expected) - sum(m[1] == d for m in missed)
                at_stage = caught - sum(m[1] == d for m in wrong)
                totals[view, d][0] += at_stage
                totals[view, d][1] += caught
                totals[view, d][2] += len(expected)
                cells.append(f"{d} {at_stage}/{caught}/{len(expected)}")
            stages = ", ".join(sorted(set(expected.values()))) or "(changes no catalog case)"
            print(f"{name:<36} {view:<15} " + ", ".join(cells)
                  + f"  at {stages}  ({time.perf_counter() - start:.1f} s)", flush=True)
            for miss in (missed + wrong)[:4]:
                print(f"    not caught at its stage: {miss}")
    for view in VIEWS:
        print(f"kill list ({precision}, {view}) at its first changed stage / caught / changed: "
              + ", ".join(f"{d} {a}/{c}/{n}" for d in DTYPES for a, c, n in [totals[view, d]]), flush=True)


def supplement_figures() -> None:
    """The bugs no catalog case shows (NOT_IN_THE_CATALOG), on tests/variant_cases.py's "everything"."""
    import tempfile

    import mhaspec
    from tests.variant_cases import judged_variants, written_golden

    with tempfile.TemporaryDirectory() as folder:
        golden, ids = written_golden(["everything"], Path(folder) / "golden")
        for name in NOT_IN_THE_CATALOG:
            for view in VIEWS:
                adapter = adapter_of(name, view)
                stage = first_changed_backward_stage(adapter, golden.load(ids[0]))
                with judged_variants():
                    report = mhaspec.check(adapter, cases=ids, golden=golden, timeout=None, isolate=False,
                                           backward=True)
                cells = [f"{r.dtype} {r.verdict} at {r.first_failing_stage}" for r in report.results]
                print(f"{name} on 'everything' ({view}, first changed: {stage}): " + ", ".join(cells), flush=True)


def margin_figures() -> None:
    smallest = {d: float("inf") for d in DTYPES}
    for name, (_, precision) in CORRECT.items():
        for view in VIEWS:
            report = variant_report(adapter_of(name, view), precision, backward=True)
            cells = []
            for d in DTYPES:
                results = [r for r in report.results if r.dtype == d]
                stages = [(st.worst_ratio or 0.0, r.case, st.stage) for r in results for st in r.stages
                          if st.verdict in (PASS, FAIL)]
                worst = max(stages, default=(0.0, "", ""))
                margin = 1 / worst[0] if worst[0] else float("inf")
                smallest[d] = min(smallest[d], margin)
                passing = sum(r.verdict == PASS for r in results)
                vague = sum(r.verdict == UNINFORMATIVE for r in results)
                cells.append(f"{d} {passing}/{len(results)} pass" + (f" ({vague} uninformative)" if vague else "")
                             + f", margin {margin:.3g}x ({worst[1]} {worst[2]})")
            print(f"{name:<22} {view:<15} {precision:<10} " + ", ".join(cells), flush=True)
    print("correct implementations' smallest margin: " + ", ".join(f"{d} {m:.3g}x" for d, m in smallest.items()))


def main() -> None:
    _, ids = variant_golden()
    print(f"variant cases: {len(ids)} ({', '.join(ids)})")
    for precision in ("standard", "worst-case"):
        kill_list_figures(precision)
    supplement_figures()
    margin_figures()


if __name__ == "__main__":
    main()
