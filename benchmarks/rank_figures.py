"""Figures of the two-sided proof of sharded judging (tests/test_rank_proofs.py), per dtype: how many
(bug, world, case) triples of the kill list (tests/rank_zoo.py) are caught — of those whose float64 result the
bug changes — and how many at exactly the ranks, stages and ring steps it changes first; and the smallest
margin (tolerance / error) of the correct numpy distributed adapters over every case they shard at world 2
and 4.

    PYTHONPATH=src python benchmarks/rank_figures.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.conformance import FAIL  # noqa: E402
from tests.rank_zoo import CORRECT, DTYPES, REACH, correct_cases, float64_changes, judged  # noqa: E402

WORLDS = (2, 4)


def where_caught(res) -> dict[int, tuple[str | None, int | None]]:
    """{failing rank: (its first failing stage, its first failing ring step)} of a judged case."""
    out = {}
    for r in res.ranks:
        if r.verdict == FAIL:
            ring = next((int(s.stage[9:-1]) for s in r.stages if s.verdict == FAIL and s.stage.startswith("ring_")),
                        None)
            out[r.rank] = (r.first_failing_stage, ring)
    return out


def main() -> None:
    start = time.perf_counter()
    caught = {dt: [0, 0, 0] for dt in DTYPES}  # caught, at exactly the expected ranks/stages/steps, triples
    missed = []
    for bug in REACH:
        for world in WORLDS:
            expected = float64_changes(bug, world)
            for res in judged(bug(), world, REACH[bug]):
                if not expected[res.case]:
                    continue  # the bug changes nothing there: nothing to catch
                counts = caught[res.dtype]
                counts[2] += 1
                if res.verdict == FAIL:
                    counts[0] += 1
                    counts[1] += where_caught(res) == expected[res.case]
                else:
                    missed.append(f"{bug.name} world {world} {res.case} {res.dtype}: {res.verdict}")
    worst = {dt: (0.0, "") for dt in DTYPES}
    per_adapter = {}
    for name in CORRECT:
        for world in WORLDS:
            row = dict.fromkeys(DTYPES, 0.0)
            for res in judged(name, world, correct_cases(name, world)):
                ratio = res.worst_ratio or 0.0
                if res.verdict != "pass":
                    missed.append(f"{name} world {world} {res.case} {res.dtype}: {res.verdict} {res.message}")
                row[res.dtype] = max(row[res.dtype], ratio)
                if ratio > worst[res.dtype][0]:
                    worst[res.dtype] = (ratio, f"{name} world {world} on {res.case}")
            per_adapter[f"{name} world {world}"] = row
    print(f"kill list: {len(REACH)} bugs × world {', '.join(map(str, WORLDS))} × the catalog cases that reach "
          f"them; correct adapters: {len(CORRECT)}")
    print(f"{'dtype':10} {'caught':>8} {'at rank+stage+step':>19}  smallest margin of the correct adapters")
    for dt in DTYPES:
        n, at, total = caught[dt]
        ratio, where = worst[dt]
        margin = f"{1 / ratio:.3g}x ({where})" if ratio else "-"
        print(f"{dt:10} {n:>3}/{total:<4} {at:>9}/{total:<9}  {margin}")
    print("\nsmallest margin per correct adapter (tolerance / error over every case it shards):")
    print(f"{'':26}" + "".join(f"{dt:>10}" for dt in DTYPES))
    for label, row in per_adapter.items():
        print(f"{label:26}" + "".join(f"{(1 / x if x else float('inf')):>9.3g}x" for x in row.values()))
    for line in missed:
        print("NOT AS PROVEN:", line)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
