"""Benchmark: the whole catalog in all four dtypes through each ONNX adapter.

Target (issue #14): each adapter's catalog run <= 5 s beyond imports.
Imports (onnx, onnxruntime, torch, onnxscript) and a first warm-up case are
done before the clock starts; then ``mhaspec.check(ADAPTER)`` runs every case
× dtype in this process.  For ``torch-onnx`` the split shows where the time
goes: ``torch.onnx.export`` (once per case × dtype: the graph's sizes are
fixed at export) against building the onnxruntime session and running it.

    python benchmarks/bench_onnx.py [onnxruntime onnx-reference torch-onnx]
"""

from __future__ import annotations

import sys
import time


def bench(name: str) -> None:
    import mhaspec
    from mhaspec.adapters import load_adapter

    adapter = load_adapter(name)
    mhaspec.check(adapter, cases=["single_token"], dtypes=["float32"])  # imports and first-call set-up
    export_s = 0.0
    if name == "torch-onnx":
        from mhaspec.adapters import torch_onnx

        original = torch_onnx.export_model

        def timed(*args, **kwargs):
            nonlocal export_s
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                export_s += time.perf_counter() - start

        torch_onnx.export_model = timed
    start = time.perf_counter()
    report = mhaspec.check(adapter)
    total = time.perf_counter() - start
    n = len(report.results)
    counts = ", ".join(f"{v} {k}" for k, v in report.counts().items() if v)
    adapter_s = sum(r.adapter_s for r in report.results)
    print(f"{name}: {total:.2f} s for {n} case×dtype ({counts}); target <= 5 s beyond imports")
    print(f"  adapter: {adapter_s:.2f} s, judging and harness: {total - adapter_s:.2f} s")
    if name == "torch-onnx":
        print(f"  of which torch.onnx.export: {export_s:.2f} s; onnxruntime session + run: {adapter_s - export_s:.2f} s")


def main() -> None:
    names = sys.argv[1:] or ["onnxruntime", "onnx-reference", "torch-onnx"]
    for name in names:
        bench(name)


if __name__ == "__main__":
    main()
