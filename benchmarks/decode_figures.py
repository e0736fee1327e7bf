"""Figures of the two-sided proof of per-call decode judging (tests/test_decode_proofs.py), per dtype:
how many (bug, case) pairs of the kill list are caught (of those whose float64 result the bug changes),
how many at the expected call and stage, and the smallest margin (tolerance / error) of the correct
decodes over every judged call.

    PYTHONPATH=src python benchmarks/decode_figures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.decode_zoo import CORRECT, KILL_LIST, decode_results, expected_calls, first_failing_call  # noqa: E402


def main() -> None:
    caught = {dt: [0, 0, 0] for dt in DTYPES}  # caught, at the expected call and stage, pairs
    for name, impl in KILL_LIST.items():
        expected = expected_calls(impl)
        for r in decode_results(impl):
            if r.case not in expected:
                continue
            counts = caught[r.dtype]
            counts[2] += 1
            if r.verdict == FAIL:
                counts[0] += 1
                counts[1] += first_failing_call(r) == expected[r.case]
    worst = {dt: (0.0, "") for dt in DTYPES}
    for name, impl in CORRECT.items():
        for r in decode_results(impl):
            for call in r.calls:
                if (call.worst_ratio or 0.0) > worst[r.dtype][0]:
                    worst[r.dtype] = (call.worst_ratio, f"{name} on {r.case}, call {call.call} of {call.of}")
    print(f"kill list: {len(KILL_LIST)} bugs; correct decodes: {len(CORRECT)}")
    print(f"{'dtype':10} {'caught':>8} {'at call+stage':>14}  smallest margin of the correct decodes")
    for dt in DTYPES:
        n, at, pairs = caught[dt]
        ratio, where = worst[dt]
        margin = f"{1 / ratio:.3g}x ({where})" if ratio else "-"
        print(f"{dt:10} {n:>3}/{pairs:<4} {at:>6}/{pairs:<7}  {margin}")
    print("\nsmallest margin per correct decode (tolerance / error over every call):")
    print(f"{'':16}" + "".join(f"{dt:>10}" for dt in DTYPES))
    for name, impl in CORRECT.items():
        row = {dt: max((c.worst_ratio or 0.0) for r in decode_results(impl) if r.dtype == dt for c in r.calls)
               for dt in DTYPES}
        print(f"{name:16}" + "".join(f"{(1 / x if x else float('inf')):>9.3g}x" for x in row.values()))


if __name__ == "__main__":
    main()
