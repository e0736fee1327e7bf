"""Benchmark: each JAX/Flax adapter over the whole catalog, beyond the framework's import.

Target (issue #13): each catalog run <= 8 s beyond `import jax, flax`, and a warm
`tox -p` <= 120 s on the 2-core CI machine.

For every adapter, a fresh process imports jax and flax (timed), then runs the
whole catalog in all four dtypes twice over: "before" compiles with XLA's
default options (`fast_compile=False`, what the adapters did before), "after"
with the adapters' fast-compile options (`fast_compile=True`, the default).
Wall time depends on what else runs on the machine, so the process CPU time
(user + sys) is printed too, and the load average when the run started.

    python benchmarks/bench_jax.py                  # every JAX/Flax adapter, before and after
    python benchmarks/bench_jax.py jax flax-nnx     # some of them
    python benchmarks/bench_jax.py --after-only --reports DIR   # and keep the reports for `mhaspec matrix`
    python benchmarks/bench_jax.py --tox            # also time a warm `tox -p` (run it on a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ADAPTERS = ["jax", "jax-dpa", "flax-linen", "flax-nnx", "flax-nnx-fast"]

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import jax, flax.linen, flax.nnx  # noqa: F401  the framework import, not counted below
import jax.numpy as jnp
jnp.zeros(1).block_until_ready()  # backend start-up belongs to the import too
t1 = time.perf_counter()
r0 = resource.getrusage(resource.RUSAGE_SELF)
import mhaspec
from mhaspec.adapters import load_adapter
report = mhaspec.check(load_adapter(sys.argv[1], fast_compile=sys.argv[2] == "1"))
t2 = time.perf_counter()
r1 = resource.getrusage(resource.RUSAGE_SELF)
if sys.argv[3]:
    report.write_json(sys.argv[3])
print(json.dumps({
    "import_s": t1 - t0, "run_s": t2 - t1,
    "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
    "ok": report.ok, "counts": report.counts(),
}))
"""


def measure(adapter: str, fast: bool, report: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, adapter, "1" if fast else "0", report],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{adapter}: the benchmark process exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="*", default=ADAPTERS)
    parser.add_argument("--after-only", action="store_true", help="skip the XLA-default ('before') runs")
    parser.add_argument("--tox", action="store_true", help="also time `tox -p` (its envs must exist: warm)")
    parser.add_argument("--reports", metavar="DIR", help="write each 'after' run's JSON report here (for mhaspec matrix)")
    args = parser.parse_args()

    print(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'adapter':<14} {'mode':<7} {'import s':>8} {'run wall s':>10} {'run cpu s':>9}  target run <= 8 s  verdicts")
    for name in args.adapters:
        for fast in ([True] if args.after_only else [False, True]):
            report = os.path.join(args.reports, f"{name}.json") if args.reports and fast else ""
            m = measure(name, fast, report)
            verdict = "conforms" if m["ok"] else "DOES NOT CONFORM"
            counts = ", ".join(f"{n} {v}" for v, n in m["counts"].items() if n)
            hit = "yes" if m["run_s"] <= 8 else ("cpu only" if m["cpu_s"] <= 8 else "no")
            print(f"{name:<14} {'after' if fast else 'before':<7} {m['import_s']:>8.2f} {m['run_s']:>10.2f} "
                  f"{m['cpu_s']:>9.2f}  {hit:<17} {verdict} ({counts})", flush=True)

    if args.tox:
        start = time.perf_counter()
        load = os.getloadavg()[0]
        proc = subprocess.run(["tox", "-p"], capture_output=True, text=True)
        wall = time.perf_counter() - start
        print(f"tox -p (warm): {wall:.1f} s wall, exit {proc.returncode}, load average {load:.1f} at start "
              f"(target <= 120 s)")


if __name__ == "__main__":
    main()
