"""The power of the local checks alone, per dtype: how many bugs each local check names.

For every bug of tests/variants.py with every stage exposed, on every (case, dtype) where
it changes the float64 result: whether the *local* check (the stage recomputed in float64
from the adapter's own previous stages, docs/tolerances.md "Local checks") fails at the
bug's own stage, and the local ratio there.  Then the same for the correct variants: their
largest local ratio per stage.  Run it on two commits to see what a change to the local
bounds costs in power (the zoo is the checkout's tests/, the model is whatever
``import mhaspec`` finds):

    python benchmarks/local_check_figures.py
    PYTHONPATH=OLD_CHECKOUT/src python benchmarks/local_check_figures.py   # an older model, this zoo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import FAIL, PASS  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.variants import BUGS, CORRECT  # noqa: E402
from tests.zoo import applies, visible_cases  # noqa: E402

#: the stages that have a local check (each recomputed from the one(s) before it)
LOCAL_STAGES = ("scores", "attn_weights", "head_outputs", "concat", "output")


def bug_figures(precision: str) -> None:
    print(f"\n== bugs named by the local check at their own stage, precision {precision} ==")
    rows: dict[str, dict[str, list[float]]] = {}  # stage -> dtype -> local ratios of the visible pairs
    for name, (adapter, stage) in sorted(BUGS.items()):
        if stage not in LOCAL_STAGES:
            continue
        visible = visible_cases(adapter)
        for r in mhaspec.check(adapter, timeout=None, precision=precision, isolate=False).results:
            if r.case not in visible or not applies(adapter, r.dtype):
                continue
            st = next((x for x in r.stages if x.stage == stage), None)
            if st is None:  # the run ended in an error before the stage was judged
                continue
            ratio = st.local_worst_ratio if st.local_worst_ratio is not None else 0.0
            if st.verdict == FAIL and "local" in st.failed_check and st.local_worst_ratio is None:
                ratio = np.inf  # failed locally on shape or NaN
            rows.setdefault(stage, {d: [] for d in DTYPES})[r.dtype].append(ratio)
    print(f"{'stage':<13} " + "  ".join(f"{d + ': named, median ratio':>32}" for d in DTYPES))
    for stage in LOCAL_STAGES:
        if stage not in rows:
            continue
        cells = []
        for d in DTYPES:
            a = np.array(rows[stage][d])
            cells.append(f"{int((a > 1).sum()):>4}/{a.size:<4} = {(a > 1).mean():>6.1%}, {np.median(a):>9.3g}"
                         if a.size else f"{'—':>32}")
        print(f"{stage:<13} " + "  ".join(f"{c:>32}" for c in cells))


def correct_figures(precision: str) -> None:
    print(f"\n== correct variants (every stage exposed): largest local ratio per stage, precision {precision} ==")
    worst = {s: {d: 0.0 for d in DTYPES} for s in LOCAL_STAGES}
    for adapter in CORRECT.values():
        for r in mhaspec.check(adapter, timeout=None, precision=precision, isolate=False).results:
            for st in r.stages:
                if st.stage in worst and st.verdict in (PASS, FAIL) and st.local_worst_ratio is not None:
                    worst[st.stage][r.dtype] = max(worst[st.stage][r.dtype], st.local_worst_ratio)
    print(f"{'stage':<13} " + " ".join(f"{d:>9}" for d in DTYPES))
    for stage in LOCAL_STAGES:
        print(f"{stage:<13} " + " ".join(f"{worst[stage][d]:>9.3g}" for d in DTYPES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("standard", "worst-case", "both"), default="standard")
    args = parser.parse_args()
    print(f"model: {Path(mhaspec.__file__).parent}")
    for precision in (("standard", "worst-case") if args.precision == "both" else (args.precision,)):
        bug_figures(precision)
        correct_figures(precision)


if __name__ == "__main__":
    main()
