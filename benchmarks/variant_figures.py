"""Benchmark: the attention variants' two-sided proof, per dtype (issue 31's "done when").

Prints, for each bug of the kill list (tests/variants.py: KILL_LIST, every stage exposed and
output only), the case×dtype it is rejected in among those where it changes the float64 result,
the share per dtype, and for each correct implementation (CORRECT and VARIANT_CORRECT) its smallest
margin (tolerance / error at the worst element) per dtype, on the variant cases
(tests/variant_cases.py: variant_golden).

    PYTHONPATH=src python benchmarks/variant_figures.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import ERROR, FAIL, PASS  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.variant_cases import expected_stages, variant_golden, variant_report  # noqa: E402
from tests.variants import CORRECT, KILL_LIST, OUTPUT_ONLY_KILL_LIST, VARIANT_CORRECT, output_only  # noqa: E402


def kill_list_figures() -> None:
    totals = {d: [0, 0] for d in DTYPES}
    for name, (adapter, _) in {**KILL_LIST, **OUTPUT_ONLY_KILL_LIST}.items():
        start = time.perf_counter()
        expected = expected_stages(adapter)
        by = {(r.case, r.dtype): r for r in variant_report(adapter).results}
        cells = []
        for d in DTYPES:
            caught = [c for c, stage in expected.items() if by[c, d].verdict == ERROR
                      or (by[c, d].verdict == FAIL and by[c, d].first_failing_stage == stage)]
            totals[d][0] += len(caught)
            totals[d][1] += len(expected)
            cells.append(f"{d} {len(caught)}/{len(expected)}")
        print(f"{name:<46} " + ", ".join(cells) + f"  ({time.perf_counter() - start:.1f} s)", flush=True)
    print("kill list caught at its stage where it changes the float64 result: "
          + ", ".join(f"{d} {a}/{b} = {100 * a / max(b, 1):.1f}%" for d, (a, b) in totals.items()))


def margin_figures() -> None:
    smallest = {d: float("inf") for d in DTYPES}
    for name, v in {**CORRECT, **VARIANT_CORRECT}.items():
        for label, adapter in ((name, v), (name + "+output_only", output_only(v))):
            report = variant_report(adapter)
            cells = []
            for d in DTYPES:
                results = [r for r in report.results if r.dtype == d]
                worst = max(((st.worst_ratio or 0.0) for r in results for st in r.stages
                             if st.verdict in (PASS, FAIL)), default=0.0)
                passing = sum(r.verdict == PASS for r in results)
                margin = 1 / worst if worst else float("inf")
                smallest[d] = min(smallest[d], margin)
                cells.append(f"{d} {passing}/{len(results)} pass, margin {margin:.3g}x")
            print(f"{label:<46} " + ", ".join(cells), flush=True)
    print("correct implementations' smallest margin: " + ", ".join(f"{d} {m:.3g}x" for d, m in smallest.items()))


def main() -> None:
    _, ids = variant_golden()
    print(f"variant cases: {len(ids)} ({', '.join(ids)})")
    kill_list_figures()
    margin_figures()


if __name__ == "__main__":
    main()
