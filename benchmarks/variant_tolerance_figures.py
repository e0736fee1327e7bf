"""The variants' tolerance rules, two-sided per dtype: the worst error/tolerance of a correct plain
implementation (two orders: the spec's, and exp(s − LSE)) on each small variant case of
tests/test_variant_tolerances.py, every stage exposed and output only, under both precision contracts; and
the kill list (issue 31, forward) with the first failing stage.

    PYTHONPATH=src python benchmarks/variant_tolerance_figures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_variant_tolerances import (BUGS, CASES, DTYPES, expected_stage, first_failure, golden_of,  # noqa: E402
                                           implementation, judge, worst_ratio)
from mhaspec.conformance.compare import NOT_EXPOSED, PASS, UNINFORMATIVE  # noqa: E402


def main() -> None:
    goldens = {name: golden_of(spec) for name, spec in CASES.items()}
    print("correct plain implementations (orders scale-after, log-sum-exp), worst error/tolerance, golden and local:")
    print(f"{'dtype':9} {'precision':10} {'every stage':>12} {'output only':>12} {'rms max':>8} {'not pass':>8} {'of them uninformative':>22}  worst case/stage")
    for precision in ("standard", "worst-case"):
        for dtype in DTYPES:
            worst, worst_out, rms, bad, unsure, where = 0.0, 0.0, 0.0, 0, 0, ""
            for name, golden in goldens.items():
                for order in ("scale-after", "log-sum-exp"):
                    got = implementation(golden, dtype, order=order)
                    stages = judge(golden, dtype, got, precision)
                    bad += sum(st.verdict != PASS for st in stages)
                    r = worst_ratio(stages)
                    if r > worst:
                        st = max(stages, key=lambda s: max(s.worst_ratio or 0, s.local_worst_ratio or 0))
                        worst, where = r, f"{name}/{order}/{st.stage}"
                    rms = max([rms] + [st.rms_ratio or 0.0 for st in stages])
                    out = judge(golden, dtype, {"output": got["output"]}, precision)
                    bad += sum(st.verdict not in (PASS, NOT_EXPOSED) for st in out)
                    unsure += sum(st.verdict == UNINFORMATIVE for st in stages + out)
                    worst_out = max(worst_out, worst_ratio(out))
            print(f"{dtype:9} {precision:10} {worst:12.3f} {worst_out:12.3f} {rms:8.3f} {bad:8d} {unsure:22d}  {where}")
    print()
    print("kill list (standard contract), every stage exposed: caught at the expected first stage / cases where the "
          "bug changes the float64 result (the stage: tests/test_variant_tolerances.py BUGS); output only: caught")
    for bug, (applies, _, _) in BUGS.items():
        row = []
        for dtype in DTYPES:
            n = right = out_caught = 0
            wrong_at: set[str] = set()
            for name, golden in goldens.items():
                if not applies(golden.spec):
                    continue
                changed = implementation(golden, "float64", bug)
                if bug != "LSE in base 2" and np.array_equal(changed["output"], golden.stages["output"]):
                    continue
                n += 1
                got = implementation(golden, dtype, bug)
                first = first_failure(judge(golden, dtype, got))
                where = expected_stage(bug, golden.spec)
                right += first == where
                if first != where:
                    wrong_at.add(f"{name}:{first}")
                if bug != "LSE in base 2":
                    out_caught += first_failure(judge(golden, dtype, {"output": got["output"]})) is not None
            extra = f" ({', '.join(sorted(wrong_at))})" if wrong_at else ""
            only = "" if bug == "LSE in base 2" else f", output only {out_caught}/{n}"
            row.append(f"{dtype} {right}/{n}{only}{extra}")
        print(f"  {bug}: " + "; ".join(row))


if __name__ == "__main__":
    main()
