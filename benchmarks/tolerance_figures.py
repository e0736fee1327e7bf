"""The figures behind docs/tolerances.md: how close correct implementations come to the
tolerance, and how many bugs are rejected, per dtype.

For every correct variant of tests/variants.py (every stage exposed, and output only)
over the whole catalog: quantiles of error/tolerance (worst element of each judged
stage), of the local checks, and of the systematic-error statistic.  For every bug
(every stage exposed, and output only): the share of (bug, case, dtype) where the bug
changes the float64 result that the suite rejects, per dtype and per precision contract.

    python benchmarks/tolerance_figures.py [--precision standard|worst-case|both]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import ERROR, FAIL, PASS  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.variants import BUGS, CORRECT, NATIVE, OUTPUT_ONLY_BUGS, output_only  # noqa: E402
from tests.zoo import applies, visible_cases  # noqa: E402


def correct_figures(precision: str) -> None:
    print(f"\n== correct implementations, precision {precision} ==")
    ratios: dict[str, list[float]] = {d: [] for d in DTYPES}
    local: dict[str, list[float]] = {d: [] for d in DTYPES}
    rms: dict[str, list[float]] = {d: [] for d in DTYPES}
    adapters = [v for v in CORRECT.values()] + [output_only(v) for v in CORRECT.values()]
    if precision == "worst-case":
        adapters += list(NATIVE.values())
    failures = 0
    for adapter in adapters:
        report = mhaspec.check(adapter, timeout=None, precision=precision)
        failures += sum(r.verdict == FAIL for r in report.results)
        for r in report.results:
            for st in r.stages:
                if st.verdict not in (PASS, FAIL):
                    continue
                ratios[r.dtype].append(st.worst_ratio or 0.0)
                if st.local_worst_ratio is not None:
                    local[r.dtype].append(st.local_worst_ratio)
                if st.rms_ratio is not None:
                    rms[r.dtype].append(st.rms_ratio)
    print(f"{len(adapters)} implementations x {len(report.results)} case×dtype; failing case×dtype: {failures}")
    print(f"{'dtype':<9} {'stages':>6}  error/tolerance: median   p99    max | local max | rms(error/sigma) max")
    for d in DTYPES:
        a = np.array(ratios[d])
        print(f"{d:<9} {a.size:>6}  {np.median(a):>22.3g} {np.quantile(a, 0.99):>6.3g} {a.max():>6.3g} | "
              f"{max(local[d], default=0):>9.3g} | {max(rms[d], default=0):.3g}")


def bug_figures(precision: str) -> None:
    print(f"\n== bugs rejected where they change the float64 result, precision {precision} ==")
    totals = {d: [0, 0] for d in DTYPES}
    silent = {d: 0 for d in DTYPES}  # not rejected *and* called a pass (the rest: uninformative)
    missed: list[str] = []
    for name, (adapter, _) in {**BUGS, **OUTPUT_ONLY_BUGS}.items():
        visible = visible_cases(adapter)
        for r in mhaspec.check(adapter, timeout=None, precision=precision).results:
            if r.case in visible and applies(adapter, r.dtype):
                caught = r.verdict in (FAIL, ERROR)
                silent[r.dtype] += r.verdict == PASS
                totals[r.dtype][0] += caught
                totals[r.dtype][1] += 1
                if not caught:
                    missed.append(f"{name} on {r.case} [{r.dtype}]")
    for d, (c, n) in totals.items():
        print(f"{d:<9} {c:>4}/{n:<4} = {c / n:.1%}   (not rejected: {n - c - silent[d]} uninformative, {silent[d]} pass)")
    if missed:
        shown = missed if len(missed) <= 12 else missed[:12] + [f"… {len(missed) - 12} more"]
        print("not rejected: " + "; ".join(shown))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=("standard", "worst-case", "both"), default="both")
    args = parser.parse_args()
    for precision in (("standard", "worst-case") if args.precision == "both" else (args.precision,)):
        correct_figures(precision)
        bug_figures(precision)


if __name__ == "__main__":
    main()
