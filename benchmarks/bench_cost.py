"""Benchmark: the judge's cost against the naive float64 check, side by side (issue 36, item 5).

Target: at T = S = 1024 and 4096 (d_model = 512, H = 8, causal self-attention), a whole
``mhaspec run numpy --catalog FILE --dtype float32`` costs at most 3x the CPU seconds and
2x the peak memory of the naive check users write instead: one Python process that builds
the same inputs and weights, runs a plain float64 numpy forward and the float32
implementation (the numpy adapter), and compares every stage with
``np.testing.assert_allclose``.

A second, frugal naive check is run beside it (FRUGAL): the float64 forward keeping only the
output, the adapter's float32 forward, assert_allclose on the output alone (what a careful user
writes; the issue's 266 MB at 1024), and mhaspec's ratios against both are printed.

Each side runs as a fresh process per size, one after the other.  CPU seconds: user + sys
of the whole process tree (the runner and its worker).  Peak memory: the sum of the peak
resident sets of the runner and of its worker (each process's own peak, read from
``getrusage`` in the runner when it leaves: its own, and its reaped children's), and that memory
counted once (:func:`measure`: the runner's resident set plus its forked worker's unshared pages,
sampled; the sum of the two peaks counts the pages they share twice).  The load
average is printed beside each figure.

Before measuring, mhaspec's sources are byte-compiled (:func:`compile_sources`, as ``pip install``
does), so that neither side pays for compiling them in its process (with
``PYTHONDONTWRITEBYTECODE`` set, every process would recompile every module it imports: about
0.2 s of the runner's CPU at 1024): both sides import mhaspec (the naive checks its spec and numpy
adapter), so both are measured alike, on the judge and the checks, not on Python's compiler.

    python benchmarks/bench_cost.py [--sizes 1024,4096] [--adapter numpy]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPU_TARGET, MEMORY_TARGET = 3.0, 2.0

#: What both naive checks begin with: the case of the one-case catalog, its inputs and weights.
SETUP = r"""
import sys
import numpy as np
from mhaspec.spec import Case, resolve_catalog
from mhaspec.adapters.numpy_mha import NumpyMHA

catalog, _ = resolve_catalog(sys.argv[1])
spec = catalog[catalog.ids()[0]]
inputs, weights = spec.make_inputs(), spec.make_weights()
cfg = spec.config
B, T, S, H, D = spec.batch, spec.tgt_len, spec.src_len, cfg.H, cfg.D_k
"""

#: The naive check: what a user writes instead of mhaspec (run as ``python -c NAIVE CATALOG``).
NAIVE = SETUP + r"""
def forward(x, w):  # plain float64 multi-head attention, causal
    q = x @ w["w_q"] + w["b_q"]
    k = x @ w["w_k"] + w["b_k"]
    v = x @ w["w_v"] + w["b_v"]
    Q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    K = k.reshape(B, S, H, D).transpose(0, 2, 1, 3)
    V = v.reshape(B, S, H, D).transpose(0, 2, 1, 3)
    s = (Q @ K.transpose(0, 1, 3, 2)) * float(cfg.scale)
    keep = np.tril(np.ones((T, S), dtype=bool))
    logits = np.where(keep, s, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits, out=logits)
    p /= p.sum(axis=-1, keepdims=True)
    o = p @ V
    c = o.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    y = c @ w["w_o"] + w["b_o"]
    return {"q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p,
            "head_outputs": o, "concat": c, "output": y}

expected = forward(inputs["query"], weights)
got = NumpyMHA().run(Case.from_spec(spec, "float32", inputs, weights))
failed = []
for stage, value in expected.items():
    try:
        np.testing.assert_allclose(got[stage], value, rtol=1e-3, atol=1e-5)
    except AssertionError:
        failed.append(stage)
import resource
print("failed " + ", ".join(failed) if failed else "every stage close")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

#: The frugal naive check: what a careful user writes (``python -c FRUGAL CATALOG``): a float64
#: forward that keeps only the output (each intermediate deleted as soon as the next is made), the
#: numpy adapter's float32 forward (of which only the output is kept), assert_allclose on the output.
FRUGAL = SETUP + r"""
def forward(x, w):  # plain float64 multi-head attention, causal; keeps only the output
    Q = (x @ w["w_q"] + w["b_q"]).reshape(B, T, H, D).transpose(0, 2, 1, 3)
    K = (x @ w["w_k"] + w["b_k"]).reshape(B, S, H, D).transpose(0, 2, 1, 3)
    s = Q @ K.transpose(0, 1, 3, 2)
    del Q, K
    s *= float(cfg.scale)
    s[..., ~np.tril(np.ones((T, S), dtype=bool))] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    V = (x @ w["w_v"] + w["b_v"]).reshape(B, S, H, D).transpose(0, 2, 1, 3)
    o = s @ V
    del s, V
    c = o.transpose(0, 2, 1, 3).reshape(B, T, H * D)
    del o
    return c @ w["w_o"] + w["b_o"]

expected = forward(inputs["query"], weights)
got = NumpyMHA().run(Case.from_spec(spec, "float32", inputs, weights))["output"]
try:
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5)
    print("output close")
except AssertionError:
    print("failed output")
import resource
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

#: Runs ``python -m mhaspec ARGS`` and, as it leaves, writes its own peak RSS and its (reaped)
#: worker's to the file named by the first argument.
WRAPPED = r"""
import atexit, json, resource, runpy, sys
out = sys.argv.pop(1)
def peaks():
    with open(out, "w") as fh:
        json.dump({"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, fh)
atexit.register(peaks)
sys.argv[0] = "mhaspec"
runpy.run_module("mhaspec", run_name="__main__", alter_sys=True)
"""


def _kib(pid: int, fields: tuple[str, ...]) -> int:
    """The sum of ``fields`` (kB) in /proc/PID/smaps_rollup; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return sum(int(line.split()[1]) for line in fh if line.split(":")[0] in fields)
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


def measure(argv: list[str]) -> tuple[subprocess.CompletedProcess, float, float, int]:
    """(the finished process, its tree's CPU seconds, wall seconds, its memory counted once: KiB).

    Memory counted once: the peak, sampled every 10 ms from /proc/PID/smaps_rollup, of the
    process's resident set plus the pages of its descendants that they share with no one (USS:
    Private_Clean + Private_Dirty).  A forked worker's other resident pages are the runner's own
    (copy-on-write, never written) or shared libraries the runner maps too, already counted in
    the runner's resident set; the sum of two peak resident sets counts them twice.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        popen = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        peak = 0
        while popen.poll() is None:
            total = _kib(popen.pid, ("Rss",))
            stack = _children(popen.pid)
            while stack:
                child = stack.pop()
                total += _kib(child, ("Private_Clean", "Private_Dirty"))
                stack.extend(_children(child))
            peak = max(peak, total)
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(argv, popen.returncode, out.read(), err.read())
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc, cpu, wall, peak


def compile_sources() -> None:
    """Byte-compile the imported mhaspec's sources (``__pycache__``), as ``pip install`` does: a
    process then loads them, even under ``PYTHONDONTWRITEBYTECODE``, instead of compiling them."""
    spec = importlib.util.find_spec("mhaspec")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("mhaspec is not importable: set PYTHONPATH=src or install it")
    for folder in spec.submodule_search_locations:
        if not compileall.compile_dir(folder, quiet=1):
            sys.exit(f"byte-compiling {folder} failed")


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096", help="T = S values, comma-separated")
    parser.add_argument("--adapter", default="numpy")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    args = parser.parse_args()

    compile_sources()
    print(f"{os.cpu_count()} CPUs; targets: mhaspec <= {CPU_TARGET:g}x the CPU and <= {MEMORY_TARGET:g}x the "
          f"peak memory of the naive float64 check")
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(x) for x in args.sizes.split(",")):
            case_id = f"d{args.d_model}_h{args.heads}_t{size}_causal"
            catalog = Path(tmp) / f"{case_id}.json"
            report = Path(tmp) / f"{case_id}.report.json"
            peaks = Path(tmp) / f"{case_id}.peaks.json"
            catalog.write_text(json.dumps([{
                "id": case_id, "config": {"d_model": args.d_model, "num_heads": args.heads, "causal": True},
                "batch": 1, "tgt_len": size, "src_len": size, "inputs": "self", "seed": 1,
            }]))

            print(f"{case_id}, float32 ({load()} before the naive checks)")
            naives = {}
            for label, code in (("naive check", NAIVE), ("frugal naive", FRUGAL)):
                proc, n_cpu, n_wall, _ = measure([sys.executable, "-c", code, str(catalog)])
                if proc.returncode != 0:
                    sys.exit(f"{label} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                outcome, n_peak_text = proc.stdout.strip().rsplit("\n", 1)
                n_peak = int(n_peak_text)  # KiB (Linux), its own peak resident set
                naives[label] = (n_cpu, n_peak)
                print(f"  {label + ':':13} cpu {n_cpu:7.2f} s, wall {n_wall:7.2f} s, peak memory "
                      f"{n_peak / 2**20:6.2f} GB  ({outcome}; {load()})", flush=True)

            proc, m_cpu, m_wall, m_own = measure([sys.executable, "-c", WRAPPED, str(peaks), "run", args.adapter,
                                           "--catalog", str(catalog), "--dtype", "float32", "--report", str(report)])
            if proc.returncode not in (0, 1) or not report.exists() or not peaks.exists():
                sys.exit(f"mhaspec run exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            p = json.loads(peaks.read_text())
            m_peak = p["self"] + p["children"]
            result = json.loads(report.read_text())["results"][0]
            print(f"  mhaspec run:  cpu {m_cpu:7.2f} s, wall {m_wall:7.2f} s, peak memory {m_peak / 2**20:6.2f} GB "
                  f"(runner {p['self'] / 2**20:.2f} + worker {p['children'] / 2**20:.2f})  (verdict {result['verdict']}, worst ratio "
                  f"{result.get('worst_ratio')}, adapter {result.get('adapter_seconds') or 0:.1f} s; {load()})")
            print(f"  counted once: peak memory {m_own / 2**20:6.2f} GB (sampled: the runner's resident set + "
                  f"the worker's unshared pages)")
            for label, (n_cpu, n_peak) in naives.items():
                cpu_ratio, mem_ratio, own_ratio = m_cpu / n_cpu, m_peak / n_peak, m_own / n_peak
                print(f"  vs {label + ':':13} cpu {cpu_ratio:5.2f}x {'ok' if cpu_ratio <= CPU_TARGET else 'NOT MET'} "
                      f"(<= {CPU_TARGET:g}x), peak memory {mem_ratio:5.2f}x "
                      f"{'ok' if mem_ratio <= MEMORY_TARGET else 'NOT MET'} (<= {MEMORY_TARGET:g}x), counted once "
                      f"{own_ratio:5.2f}x {'ok' if own_ratio <= MEMORY_TARGET else 'NOT MET'}", flush=True)

if __name__ == "__main__":
    main()
