"""Benchmark: one large case judged on the fly (`mhaspec run ADAPTER --catalog`), time and peak memory.

Targets (issue #11): d_model = 512, H = 8, T = S = 1024, a float32 run of the
numpy adapter in <= 60 s and <= 4 GB on the 2-core machine; T = S = 4096 runs
at all (at the default timeout, which scales with the case's size).

Writes a one-case catalog, runs `mhaspec run ADAPTER --catalog ... --dtype ...`
in a fresh process per size and prints its wall and CPU seconds, the peak
resident memory of the runner and of its worker (the largest of the process
tree), the verdict and the seconds spent in the adapter.

    python benchmarks/bench_large.py [--sizes 1024,4096] [--adapter numpy] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024", help="T = S values, comma-separated (e.g. 1024,4096)")
    parser.add_argument("--adapter", default="numpy")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    args = parser.parse_args()

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(x) for x in args.sizes.split(",")):
            case_id = f"d{args.d_model}_h{args.heads}_t{size}"
            catalog = Path(tmp) / f"{case_id}.json"
            report = Path(tmp) / f"{case_id}.report.json"
            catalog.write_text(json.dumps([{
                "id": case_id, "config": {"d_model": args.d_model, "num_heads": args.heads},
                "batch": 1, "tgt_len": size, "src_len": size, "inputs": "self", "seed": 1,
            }]))
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "mhaspec", "run", args.adapter, "--catalog", str(catalog),
                 "--dtype", args.dtype, "--report", str(report)], capture_output=True, text=True)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            peak_gb = after.ru_maxrss / 2**20  # KiB on Linux: the largest process of the tree so far
            if proc.returncode not in (0, 1) or not report.exists():
                sys.exit(f"{case_id}: mhaspec run exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            data = json.loads(report.read_text())
            result = data["results"][0]
            print(f"{case_id} {args.dtype} ({args.adapter}): wall {wall:7.1f} s, cpu {cpu:7.1f} s, peak memory "
                  f"{peak_gb:5.2f} GB, verdict {result['verdict']}, worst ratio {result.get('worst_ratio')}, "
                  f"adapter {result.get('adapter_seconds') or 0:.1f} s "
                  f"(exit {proc.returncode})")


if __name__ == "__main__":
    main()
