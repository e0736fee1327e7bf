"""Benchmark: the backward two-sided proof, per dtype (docs/backward.md, docs/tolerances.md).

Prints, for each bug of tests/backward_variants.py, the cases×dtype it is rejected
in among those where it changes the float64 gradients, the totals per dtype, and
for each correct variant its smallest margin and number of uninformative stages.

    python benchmarks/backward_figures.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.backward_variants import BUGS, CORRECT  # noqa: E402


def main() -> None:
    totals = {d: [0, 0] for d in DTYPES}
    for name, (adapter, stage) in sorted(BUGS.items()):
        start = time.perf_counter()
        report = mhaspec.check(adapter, timeout=None, backward=True, isolate=False)
        by = {(r.case, r.dtype): r for r in report.results}
        changed = {c for (c, d), r in by.items() if d == "float64" and r.verdict == FAIL}
        cells = []
        for d in DTYPES:
            caught = sum(1 for c in changed if by[(c, d)].verdict == FAIL)
            totals[d][0] += caught
            totals[d][1] += len(changed)
            cells.append(f"{d} {caught}/{len(changed)}")
        print(f"{name:<28} ({stage}) " + ", ".join(cells) + f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print("rejected where the bug changes the float64 gradients: "
          + ", ".join(f"{d} {a}/{b} = {100 * a / max(b, 1):.1f}%" for d, (a, b) in totals.items()))
    for name, (adapter, precision) in sorted(CORRECT.items()):
        report = mhaspec.check(adapter, timeout=None, backward=True, precision=precision, isolate=False)
        unin = sum(1 for r in report.results for st in r.stages if st.verdict == "uninformative")
        print(f"correct {name} ({precision}): conforms={report.ok}, smallest margin {report.smallest_margin():.3g}x, "
              f"uninformative stages {unin}", flush=True)


if __name__ == "__main__":
    main()
