"""The variants' backward tolerances, two-sided per dtype: the worst error/tolerance (golden and local) of a
plain correct backward on each small variant case of tests/test_variant_backward_tolerances.py and on the
catalog's variant cases (the stored golden), per
precision contract and dtype — over every backward stage, and for each of the variants' own gradients
(d_sink_logits, d_bias, d_q_rot, d_k_rot) and d_q_proj (turned back with RoPE) —, the smallest error of a
variant gradient the golden check detects, and the bugs of that file with the first failing stage.

    PYTHONPATH=src python benchmarks/variant_backward_tolerance_figures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_variant_backward_tolerances import (BUGS, CASES, DTYPES, first_failure,  # noqa: E402
                                                    golden_with_backward, judge, ratio, worst_ratio, worst_stage)
from tests.backward_variants import DT  # noqa: E402
from tests.test_variant_backward_tolerances import plain_backward  # noqa: E402
from tests.test_variant_tolerances import implementation  # noqa: E402
from mhaspec.conformance.backward import judge_backward  # noqa: E402
from mhaspec.conformance.compare import PASS, UNINFORMATIVE  # noqa: E402
from mhaspec.fixtures import GoldenSet  # noqa: E402
from mhaspec.spec.variants import variants_used  # noqa: E402

SHOWN = ("d_sink_logits", "d_bias", "d_q_rot", "d_k_rot", "d_q_proj")


def correct_table(goldens: dict, what: str) -> None:
    """The worst error/tolerance of the plain backward on ``goldens``, per contract and dtype."""
    print(f"correct plain backward on {what}, worst error/tolerance (golden and local):")
    print(f"{'precision':10} {'dtype':9} {'every stage':>12} " + " ".join(f"{s:>13}" for s in SHOWN)
          + f" {'not pass':>8} {'of them uninformative':>22}  worst case/stage")
    for precision in ("standard", "worst-case"):
        for dtype in DTYPES:
            worst, where, bad, unsure, unsure_at = 0.0, "", 0, 0, set()
            per = dict.fromkeys(SHOWN, 0.0)
            for name, golden in goldens.items():
                stages = judge(golden, dtype, precision)
                bad += sum(st.verdict != PASS for st in stages)
                unsure += sum(st.verdict == UNINFORMATIVE for st in stages)
                unsure_at |= {f"{name}/{st.stage}" for st in stages if st.verdict == UNINFORMATIVE}
                for st in stages:
                    if st.stage in per:
                        per[st.stage] = max(per[st.stage], ratio(st))
                if worst_ratio(stages) > worst:
                    worst = worst_ratio(stages)
                    where = f"{name}/{worst_stage(stages)}"
            print(f"{precision:10} {dtype:9} {worst:12.3f} " + " ".join(f"{per[s]:13.3f}" for s in SHOWN)
                  + f" {bad:8d} {unsure:22d}  {where}")
            if unsure_at:
                print(f"{'':21} uninformative: {', '.join(sorted(unsure_at))}")
    print()


def main() -> None:
    goldens = {name: golden_with_backward(spec) for name, spec in CASES.items()}
    correct_table(goldens, f"{len(goldens)} small variant cases (golden built from the exact reference)")
    golden_set = GoldenSet()
    stored = {i: golden_set.load(i) for i in golden_set.ids() if variants_used(golden_set.load(i).spec)}
    correct_table(stored, f"the catalog's {len(stored)} variant cases (the stored golden)")
    sensitivity(stored)
    print()
    bugs({**goldens, **{f"catalog/{k}": v for k, v in stored.items()}})


def bugs(goldens: dict) -> None:
    """Each bug of the proof: caught at its first stage, per contract and dtype, on the cases it applies to."""
    print("bugs: caught at the expected first stage / cases it applies to (small and catalog cases)")
    for bug, (applies, stage) in BUGS.items():
        for precision in ("standard", "worst-case"):
            row = []
            for dtype in DTYPES:
                cases = {name: g for name, g in goldens.items() if applies(g.spec)}
                firsts = {name: first_failure(judge(g, dtype, precision, bug=bug)) for name, g in cases.items()}
                wrong = sorted(f"{name}:{f}" for name, f in firsts.items() if f != stage(cases[name].spec))
                row.append(f"{dtype} {len(cases) - len(wrong)}/{len(cases)}" + (f" ({', '.join(wrong)})" if wrong else ""))
            print(f"  {bug}, {precision}: " + "; ".join(row))


def sensitivity(stored: dict) -> None:
    """The smallest d_stage × (1 + 2^-k), rounded to the dtype, that fails at least half of the catalog cases
    with the stage, the stage alone returned (its golden check only), standard contract."""
    import numpy as np

    print("smallest detected error d_stage × (1 + 2^-k), that stage alone returned, >= half its catalog cases fail:")
    for stage in ("d_sink_logits", "d_bias", "d_q_rot", "d_k_rot"):
        cases = [g for g in stored.values() if stage in g.stages]
        row = []
        for dtype in DTYPES:
            plain = {g.id: plain_backward(g, dtype, implementation(g, dtype))[stage] for g in cases}
            found = next((k for k in range(24, 0, -1)
                          if 2 * sum(first_failure(judge_backward(
                              {stage: (plain[g.id] * (1 + 2.0**-k)).astype(DT[dtype]).astype(np.float64)}, g, dtype,
                              forward=implementation(g, dtype))) is not None for g in cases) >= len(cases)), None)
            row.append(f"{dtype} {'<= ' if found == 24 else ''}2^-{found}")  # 24: the scan's start
        print(f"  {stage} ({len(cases)} cases): " + "; ".join(row))


if __name__ == "__main__":
    main()
