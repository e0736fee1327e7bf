"""Figures of the two-sided proofs of per-call decode judging (tests/test_decode_proofs.py) and of paged
caches (tests/test_paged_proofs.py), per dtype: how many (bug, case) pairs of a kill list are caught (of
those whose float64 result the bug changes), how many at the expected call and stage, and the smallest
margin (tolerance / error) of the correct decodes over every judged call; for the paged caches also what
only the pool would show (tests/paged_zoo.py POOL_ONLY) and how it is judged.

    PYTHONPATH=src python benchmarks/decode_figures.py [--paged | --all]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.decode_zoo import (  # noqa: E402
    CORRECT, KILL_LIST, decode_goldens, decode_results, expected_calls, first_failing_call)
from tests.paged_zoo import CORRECT_PAGED, PAGED_KILL_LIST, POOL_ONLY_IMPLS, paged_goldens  # noqa: E402


def figures(title: str, kill_list: dict, correct: dict, goldens) -> None:
    """Prints the caught/total per dtype of ``kill_list`` and the smallest margin of ``correct`` on the
    cases of ``goldens()``."""
    caught = {dt: [0, 0, 0] for dt in DTYPES}  # caught, at the expected call and stage, pairs
    for name, impl in kill_list.items():
        expected = expected_calls(impl, goldens)
        for r in decode_results(impl, goldens):
            if r.case not in expected:
                continue
            counts = caught[r.dtype]
            counts[2] += 1
            if r.verdict == FAIL:
                counts[0] += 1
                counts[1] += first_failing_call(r) == expected[r.case]
    worst = {dt: (0.0, "") for dt in DTYPES}
    for name, impl in correct.items():
        for r in decode_results(impl, goldens):
            for call in r.calls:
                if (call.worst_ratio or 0.0) > worst[r.dtype][0]:
                    worst[r.dtype] = (call.worst_ratio, f"{name} on {r.case}, call {call.call} of {call.of}")
    cases = sum(len(ids) for _, ids in goldens())
    print(f"{title}: kill list {len(kill_list)} bugs; correct decodes {len(correct)}; {cases} cases")
    print(f"{'dtype':10} {'caught':>8} {'at call+stage':>14}  smallest margin of the correct decodes")
    for dt in DTYPES:
        n, at, pairs = caught[dt]
        ratio, where = worst[dt]
        margin = f"{1 / ratio:.3g}x ({where})" if ratio else "-"
        print(f"{dt:10} {n:>3}/{pairs:<4} {at:>6}/{pairs:<7}  {margin}")
    print("\nsmallest margin per correct decode (tolerance / error over every call):")
    print(f"{'':18}" + "".join(f"{dt:>10}" for dt in DTYPES))
    for name, impl in correct.items():
        row = {dt: max((c.worst_ratio or 0.0) for r in decode_results(impl, goldens) if r.dtype == dt for c in r.calls)
               for dt in DTYPES}
        print(f"{name:18}" + "".join(f"{(1 / x if x else float('inf')):>9.3g}x" for x in row.values()))
    print()


def pool_only() -> None:
    """What only the pool would show: the cases whose float64 result it changes, and the verdicts."""
    print("what only the pool would show (no value a call reads changes):")
    for name, impl in POOL_ONLY_IMPLS.items():
        changed = expected_calls(impl, paged_goldens)
        verdicts = sorted({r.verdict for r in decode_results(impl, paged_goldens)})
        print(f"  {name}: float64 results changed on {len(changed)} case(s); verdicts {', '.join(verdicts)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--paged", action="store_true", help="only the paged caches' figures")
    which.add_argument("--all", action="store_true", help="the schedules' and the paged caches' figures")
    args = parser.parse_args()
    if not args.paged:
        figures("decode schedules", KILL_LIST, CORRECT, decode_goldens)
    if args.paged or args.all:
        figures("paged caches", PAGED_KILL_LIST, CORRECT_PAGED, paged_goldens)
        pool_only()


if __name__ == "__main__":
    main()
