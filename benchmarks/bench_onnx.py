"""Benchmark: the whole catalog in all four dtypes through each ONNX adapter.

Target (issue #14): each adapter's catalog run <= 5 s beyond imports.

Each adapter runs in a fresh process: first the imports it needs (onnx,
onnxruntime; torch and onnxscript for the torch exporters) and the adapter's
constructor are timed ("import"), then ``mhaspec.check(adapter, isolate=False)``
runs every case × dtype in that process, judging included ("run"), from a cold
adapter: the first export (torchlib registry, torch.export warm-up) is inside
the run.  The machine is shared: the load average is printed at the start and
end of each run, and the process's CPU seconds (user + sys) next to the wall
seconds.  Counted: graphs built or exported (``torch.onnx.export`` calls for the
torch exporters) and onnxruntime sessions made.

    python benchmarks/bench_onnx.py                       # all four ONNX adapters
    python benchmarks/bench_onnx.py torch-onnx --reports DIR   # some, keeping their JSON reports
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ADAPTERS = ["onnxruntime", "onnx-reference", "torch-onnx", "torch-onnx-legacy"]

CHILD = r"""
import json, os, resource, sys, time
name, report_path = sys.argv[1], sys.argv[2]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

load0 = os.getloadavg()[0]
t0, c0 = time.perf_counter(), cpu()
import onnx, onnxruntime  # noqa: F401
if name.startswith("torch-onnx"):
    import torch, onnxscript  # noqa: F401
import mhaspec
from mhaspec.adapters import load_adapter
adapter = load_adapter(name)
t1, c1 = time.perf_counter(), cpu()

counts = {"graphs": 0, "sessions": 0}
if name in ("onnxruntime", "onnx-reference"):
    from mhaspec.adapters import onnx_attention
    def counted(key, fn):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper
    onnx_attention.case_model = counted("graphs", onnx_attention.case_model)
    onnx_attention.ort_session = counted("sessions", onnx_attention.ort_session)

report = mhaspec.check(adapter, isolate=False)
t2, c2 = time.perf_counter(), cpu()
if name.startswith("torch-onnx"):
    counts = {"graphs": adapter.exports, "sessions": adapter.sessions}
if report_path:
    report.write_json(report_path)
first = next((r.adapter_s for r in report.results if r.adapter_s), 0.0)
print(json.dumps({
    "import_s": t1 - t0, "import_cpu_s": c1 - c0, "run_s": t2 - t1, "cpu_s": c2 - c1,
    "adapter_s": sum(r.adapter_s for r in report.results), "first_s": first,
    "load": [load0, os.getloadavg()[0]], "ok": report.ok, "counts": report.counts(), **counts,
}))
"""


def measure(name: str, report: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, name, report], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name}: the benchmark process exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="*", default=ADAPTERS, help=f"default: {' '.join(ADAPTERS)}")
    parser.add_argument("--reports", metavar="DIR", help="write each run's JSON report to DIR/ADAPTER.json")
    args = parser.parse_args()
    for name in args.adapters:
        if name not in ADAPTERS:
            parser.error(f"adapter: {name!r} is not one of {', '.join(ADAPTERS)}")
    if args.reports:
        os.makedirs(args.reports, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; target: catalog run <= 5 s beyond imports")
    for name in args.adapters:
        r = measure(name, os.path.join(args.reports, f"{name}.json") if args.reports else "")
        verdicts = ", ".join(f"{v} {k}" for k, v in r["counts"].items() if v)
        print(f"{name}: import {r['import_s']:.2f} s ({r['import_cpu_s']:.2f} s CPU); "
              f"catalog run {r['run_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU "
              f"(adapter {r['adapter_s']:.2f} s, of which the first case×dtype {r['first_s']:.2f} s); "
              f"{r['graphs']} graphs built/exported, {r['sessions']} onnxruntime sessions; "
              f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}; "
              f"{'ok' if r['ok'] else 'NOT OK'} ({verdicts})", flush=True)


if __name__ == "__main__":
    main()
