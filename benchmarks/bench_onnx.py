"""Benchmark: the whole catalog in all four dtypes through each ONNX adapter.

Target (issue #14): each adapter's catalog run <= 5 s beyond imports.

``torch-onnx`` runs twice, with ``MHASPEC_CACHE_DIR`` set to a new empty folder
(cold: every structure exported) and then to the same folder (warm: every export
read from the cache), and the two runs' JSON reports are compared verdict by
verdict and stage by stage; the other adapters run once, the cache off.

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
    python benchmarks/bench_onnx.py --side-by-side        # and check every catalog structure's cut

``--side-by-side`` also checks, for every structure of the catalog, that each
dtype's cut of the side-by-side export (what ``torch-onnx`` runs) is node for
node the export of that dtype's module alone (tests/frameworks/test_onnx.py
checks two structures; this checks all, at four exports each).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

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


def measure(name: str, report: str = "", cache_dir: str = "off") -> dict:
    """One run of ``name`` in a fresh process, with ``MHASPEC_CACHE_DIR=cache_dir``."""
    env = {**os.environ, "MHASPEC_CACHE_DIR": cache_dir}
    proc = subprocess.run([sys.executable, "-c", CHILD, name, report], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{name}: the benchmark process exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def show(label: str, r: dict) -> None:
    verdicts = ", ".join(f"{v} {k}" for k, v in r["counts"].items() if v)
    print(f"{label}: import {r['import_s']:.2f} s ({r['import_cpu_s']:.2f} s CPU); "
          f"catalog run {r['run_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU "
          f"(adapter {r['adapter_s']:.2f} s, of which the first case×dtype {r['first_s']:.2f} s); "
          f"{r['graphs']} graphs built/exported, {r['sessions']} onnxruntime sessions; "
          f"load average {r['load'][0]:.1f} -> {r['load'][1]:.1f}; "
          f"{'ok' if r['ok'] else 'NOT OK'} ({verdicts})", flush=True)


#: What two runs of the same adapter must agree on, per case × dtype and per stage.
_CASE_FIELDS = ("verdict", "first_failing_stage", "worst_ratio", "message")
_STAGE_FIELDS = ("verdict", "max_abs_err", "max_rel_err", "worst_ratio", "worst_index", "compared",
                 "nonfinite", "rms_ratio", "local_worst_ratio", "failed_check", "message", "reason")


def compare_reports(a: str, b: str) -> str:
    """'agree on …' or the first difference between two JSON reports (verdicts, errors, reasons)."""
    ra, rb = (json.load(open(p)) for p in (a, b))
    ka = {(r["case"], r["dtype"]): r for r in ra["results"]}
    kb = {(r["case"], r["dtype"]): r for r in rb["results"]}
    if ka.keys() != kb.keys():
        return f"DIFFER in the case × dtype judged ({sorted(ka.keys() ^ kb.keys())[:3]})"
    stages = 0
    for key, x in ka.items():
        y = kb[key]
        for field in _CASE_FIELDS:
            if x.get(field) != y.get(field):
                return f"DIFFER at {key}: {field} {x.get(field)!r} != {y.get(field)!r}"
        for sx, sy in zip(x["stages"], y["stages"], strict=True):
            for field in _STAGE_FIELDS:
                if sx.get(field) != sy.get(field):
                    return f"DIFFER at {key} {sx['stage']}: {field} {sx.get(field)!r} != {sy.get(field)!r}"
            stages += 1
    return f"agree on all {len(ka)} case × dtype and {stages} stage verdicts, errors and reasons"


def check_side_by_side() -> None:
    from mhaspec.adapters import torch_onnx
    from mhaspec.adapters.backends.onnx import graph_structure, keep_mask
    from mhaspec.fixtures import GoldenSet

    seen: set[tuple] = set()
    same = 0
    golden = GoldenSet()
    for case_id in golden.ids():
        case = golden.load(case_id).case("float32")
        mask = keep_mask(case)
        shape = dict(batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len,
                     mask_shape=None if mask is None else mask.shape)
        key = (case.config.model_dump_json(), *shape.values())
        if key in seen:
            continue
        seen.add(key)
        cuts = torch_onnx.export_models(case.config, **shape)
        for dtype, cut in cuts.items():
            alone = torch_onnx.export_model(case.config, dtype, **shape)
            if graph_structure(cut) != graph_structure(alone):
                sys.exit(f"{case_id} {dtype}: the side-by-side cut differs from the export of the module alone")
            same += 1
    print(f"side by side: {len(seen)} structures, {same} structure × dtype cuts identical to their own export")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="*", default=ADAPTERS, help=f"default: {' '.join(ADAPTERS)}")
    parser.add_argument("--reports", metavar="DIR", help="write each run's JSON report to DIR/ADAPTER.json")
    parser.add_argument("--side-by-side", action="store_true",
                        help="check every catalog structure's side-by-side export against its own exports")
    args = parser.parse_args()
    for name in args.adapters:
        if name not in ADAPTERS:
            parser.error(f"adapter: {name!r} is not one of {', '.join(ADAPTERS)}")
    if args.reports:
        os.makedirs(args.reports, exist_ok=True)
    print(f"{os.cpu_count()} CPUs; target: catalog run <= 5 s beyond imports")
    for name in args.adapters:
        report = os.path.join(args.reports, f"{name}.json") if args.reports else ""
        if name != "torch-onnx":  # no cache: one run
            show(name, measure(name, report))
            continue
        # torch-onnx keeps its exports in the cache folder: a first run (empty folder), then a second
        with tempfile.TemporaryDirectory(prefix="mhaspec-bench-cache-") as folder:
            reports = [os.path.join(folder, f"{run}.json") for run in ("cold", "warm")]
            show(f"{name} (cold: empty cache)", measure(name, reports[0], folder))
            show(f"{name} (warm: the same cache)", measure(name, reports[1], folder))
            print(f"{name}: cold and warm reports {compare_reports(*reports)}", flush=True)
            if report:
                shutil.copy(reports[1], report)
    if args.side_by_side:
        check_side_by_side()


if __name__ == "__main__":
    main()
