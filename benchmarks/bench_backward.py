"""Benchmark: the whole catalog in all four dtypes, forward and backward, through the numpy adapter.

Target (issue #12): `mhaspec run numpy --backward` <= 4 s wall, start to end, including
interpreter start-up.  Prints the wall time in a fresh process, then the split of the
in-process time between the adapter (run + backward) and judging (tolerances, local
checks, comparison).

    python benchmarks/bench_backward.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    walls = []
    command = [sys.executable, "-m", "mhaspec", "run", "numpy", "--backward"]
    for _ in range(args.repeat):
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode != 0:
            sys.exit(f"mhaspec run numpy --backward exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    import mhaspec

    start = time.perf_counter()
    report = mhaspec.check("numpy", backward=True)
    total = time.perf_counter() - start
    n = len(report.results)
    adapter = sum(r.adapter_s for r in report.results)
    judging = sum(r.harness_s for r in report.results)
    print(f"`mhaspec run numpy --backward` wall, fresh process: median {statistics.median(walls):.2f} s "
          f"(min {min(walls):.2f}, max {max(walls):.2f}, {args.repeat} runs; target <= 4 s)")
    print(f"in-process check(backward=True): {total * 1e3:.0f} ms for {n} case×dtype")
    print(f"  adapter compute (run + backward): {adapter * 1e3:.0f} ms ({adapter / n * 1e3:.2f} ms per case)")
    print(f"  judging (forward and backward bounds, local checks, comparison): {judging * 1e3:.0f} ms "
          f"({judging / n * 1e3:.2f} ms per case)")
    other = total - adapter - judging
    print(f"  other harness (fixture load + verify, threads, report): {other * 1e3:.0f} ms ({other / n * 1e3:.2f} ms per case)")


if __name__ == "__main__":
    main()
