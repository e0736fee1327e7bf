"""Figures of the two-sided proofs of per-call decode judging (tests/test_decode_proofs.py), of paged caches
(tests/test_paged_proofs.py) and of per-sequence packed judging (tests/test_packed_proofs.py), per dtype: how many (bug, case) pairs of each
kill list are caught (of those whose float64 result the bug changes), how many at the expected call (or
sequence) and stage, and the smallest margin (tolerance / error) of the correct implementations over every
judged call (sequence).

    PYTHONPATH=src python benchmarks/decode_figures.py [decode|paged|packed]…

For the paged caches also what only the pool would show (tests/paged_zoo.py POOL_ONLY) and how it is judged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests import decode_zoo, packed_zoo, paged_zoo  # noqa: E402
from tests.decode_zoo import first_failing_call  # noqa: E402


def figures(what: str, kill_list: Mapping[str, Any], correct: Mapping[str, Any], results: Callable[[Any], list[Any]],
            expected: Callable[[Any], dict[str, tuple[int, str]]]) -> None:
    """Print one proof's figures: ``what`` names its unit ("call", "sequence")."""
    caught = {dt: [0, 0, 0] for dt in DTYPES}  # caught, at the expected call and stage, pairs
    for impl in kill_list.values():
        where = expected(impl)
        for r in results(impl):
            if r.case not in where:
                continue
            counts = caught[r.dtype]
            counts[2] += 1
            if r.verdict == FAIL:
                counts[0] += 1
                counts[1] += first_failing_call(r) == where[r.case]
    worst = {dt: (0.0, "") for dt in DTYPES}
    for name, impl in correct.items():
        for r in results(impl):
            for call in r.calls:
                if (call.worst_ratio or 0.0) > worst[r.dtype][0]:
                    worst[r.dtype] = (call.worst_ratio, f"{name} on {r.case}, {what} {call.call} of {call.of}")
    print(f"kill list: {len(kill_list)} bugs; correct implementations: {len(correct)}")
    print(f"{'dtype':10} {'caught':>8} {'at ' + what + '+stage':>18}  smallest margin of the correct implementations")
    for dt in DTYPES:
        n, at, pairs = caught[dt]
        ratio, place = worst[dt]
        margin = f"{1 / ratio:.3g}x ({place})" if ratio else "-"
        print(f"{dt:10} {n:>3}/{pairs:<4} {at:>10}/{pairs:<7}  {margin}")
    print(f"\nwhere each bug must first be caught ({what}, stage; float64 run against the golden):")
    for name, impl in kill_list.items():
        where = expected(impl)
        print(f"  {name}: {len(where)} case(s): " + ", ".join(f"{c} {what} {k + 1} {st}" for c, (k, st) in where.items()))
    print(f"\nsmallest margin per correct implementation (tolerance / error over every {what}):")
    print(f"{'':16}" + "".join(f"{dt:>10}" for dt in DTYPES))
    for name, impl in correct.items():
        row = {dt: max((c.worst_ratio or 0.0) for r in results(impl) if r.dtype == dt for c in r.calls)
               for dt in DTYPES}
        print(f"{name:18}" + "".join(f"{(1 / x if x else float('inf')):>9.3g}x" for x in row.values()))
    print()


def pool_only() -> None:
    """What only the pool would show: the cases whose float64 result it changes, and the verdicts."""
    print("\nwhat only the pool would show (no value a call reads changes):")
    for name, impl in paged_zoo.POOL_ONLY_IMPLS.items():
        changed = decode_zoo.expected_calls(impl, paged_zoo.paged_goldens)
        verdicts = sorted({r.verdict for r in decode_zoo.decode_results(impl, paged_zoo.paged_goldens)})
        print(f"  {name}: float64 results changed on {len(changed)} case(s); verdicts {', '.join(verdicts)}")


def main() -> None:
    which = sys.argv[1:] or ["decode", "paged", "packed"]
    if "decode" in which:
        print("== decode schedules (tests/decode_zoo.py) ==")
        figures("call", decode_zoo.KILL_LIST, decode_zoo.CORRECT, decode_zoo.decode_results, decode_zoo.expected_calls)
    if "paged" in which:
        print("\n== paged caches (tests/paged_zoo.py) ==")
        figures("call", paged_zoo.PAGED_KILL_LIST, paged_zoo.CORRECT_PAGED,
                lambda impl: decode_zoo.decode_results(impl, paged_zoo.paged_goldens),
                lambda impl: decode_zoo.expected_calls(impl, paged_zoo.paged_goldens))
        pool_only()
    if "packed" in which:
        print("\n== packed sequences (tests/packed_zoo.py) ==")
        figures("sequence", packed_zoo.KILL_LIST, packed_zoo.CORRECT, packed_zoo.packed_results,
                packed_zoo.expected_sequences)


if __name__ == "__main__":
    main()
