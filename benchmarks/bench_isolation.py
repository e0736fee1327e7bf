"""Benchmark: the cost of running the adapter in a worker process.

Runs `mhaspec run ADAPTER` in fresh processes, alternating the default
(isolated: the adapter in a worker process) and `--no-isolate` (the adapter in
the runner's process, as before issue #10), and prints the median wall time of
each and the overhead.  Targets (issue #10): `mhaspec run numpy` <= 2 s; a
framework adapter's whole run no more than 10 % slower.

    python benchmarks/bench_isolation.py [ADAPTER ...] [--repeat N] [--base-src DIR]

``--base-src DIR`` also times another source tree (e.g. an export of the
commit before isolation: ``git archive COMMIT src | tar -x -C DIR``), run
with ``PYTHONPATH=DIR/src``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _wall(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mhaspec", "run", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"mhaspec run {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="*", default=["numpy"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--base-src", metavar="DIR", help="also time this source tree (PYTHONPATH=DIR/src)")
    args = parser.parse_args()
    env = dict(os.environ)
    base_env = dict(env, PYTHONPATH=os.path.join(args.base_src, "src")) if args.base_src else None
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for adapter in args.adapters:
        runs: dict[str, list[float]] = {"isolated": [], "--no-isolate": []}
        if base_env:
            runs["base tree"] = []
        for _ in range(args.repeat):  # alternate, so a change in machine load hits every variant alike
            runs["isolated"].append(_wall([adapter], env))
            runs["--no-isolate"].append(_wall([adapter, "--no-isolate"], env))
            if base_env:
                runs["base tree"].append(_wall([adapter], base_env))
        iso = statistics.median(runs["isolated"])
        for name, walls in runs.items():
            med = statistics.median(walls)
            rel = "" if name == "isolated" else f"  isolated is {100 * (iso / med - 1):+.1f} %"
            print(f"mhaspec run {adapter:<14} {name:<13} median {med:6.2f} s (min {min(walls):.2f}, "
                  f"max {max(walls):.2f}, {len(walls)} runs){rel}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
