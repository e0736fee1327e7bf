"""Benchmark: what speaking mhaspec-wire/1 to a program (``exec:``) costs (docs/protocol.md §8).

1. **Per-case overhead on the catalog.**  The same numpy computation (the ``numpy`` adapter) judged
   on the whole catalog (28 cases × 4 dtypes) three ways: in this process (``isolate=False``), in
   mhaspec's Python worker, and as a program (tests/exec_client.py, which frames its messages by
   hand as a program in another language does).  Each way runs ``--repeat`` times; the fastest run
   counts.  Printed: seconds per run and per case × dtype, and the program's overhead per case
   against each of the other two.
2. **A large case streamed.**  One T = S = 2048, d_model = 512, H = 8, float32 self-attention case
   sent to the C client of examples/exec/c (built here with gcc) and its 8 stages read back.
   Printed: the request's and the reply's payload sizes, the runner's peak of new allocations while
   the case crosses (tracemalloc: what the transport itself allocated — one copy of the reply, the
   buffer the arrays view, is the floor), the runner's and the program's peak RSS, and the seconds.

    python benchmarks/bench_exec.py [--repeat 3] [--skip-large]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import mhaspec  # noqa: E402
from mhaspec.adapters.numpy_mha import NumpyMHA  # noqa: E402

CLIENT = ROOT / "tests" / "exec_client.py"
LARGE = {"id": "large_2048", "config": {"d_model": 512, "num_heads": 8}, "batch": 1, "tgt_len": 2048,
         "src_len": 2048, "inputs": "self", "seed": 1}


def _best(run, repeat: int) -> tuple[float, int]:
    best, count = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        report = run()
        best = min(best, time.perf_counter() - start)
        assert report.ok, report
        count = len(report.results)
    return best, count


def overhead(repeat: int) -> None:
    program = f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(CLIENT))}"
    ways = {
        "in this process (isolate=False)": lambda: mhaspec.check(NumpyMHA(), isolate=False, timeout=None),
        "mhaspec's Python worker (numpy)": lambda: mhaspec.check("numpy", timeout=None),
        "a program (exec:, Python client)": lambda: mhaspec.check(program, timeout=None),
    }
    seconds = {}
    for label, run in ways.items():
        seconds[label], count = _best(run, repeat)
        print(f"  {label:<36} {seconds[label]:6.2f} s   {1000 * seconds[label] / count:6.1f} ms per case×dtype "
              f"({count} case×dtype, best of {repeat})", flush=True)
    from mhaspec.protocol.transports import Program

    starts = []
    for _ in range(repeat):
        start = time.perf_counter()
        transport = Program(program)
        transport.wait_loaded()
        starts.append(time.perf_counter() - start)
        transport.close()
    print(f"  of which starting the program (to its ready: python, numpy and mhaspec imported): "
          f"{min(starts):.2f} s, once per run")
    labels = list(ways)
    for other in labels[:2]:
        extra = (seconds[labels[2]] - min(starts) - seconds[other]) / count
        print(f"  the program's overhead per case×dtype against {other}, its start left out: {1000 * extra:+.1f} ms")


def _build_c(into: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit("bench_exec: the large case needs gcc (it builds examples/exec/c/mha.c)")
    binary = into / "mha_c"
    subprocess.run([gcc, "-O2", "-std=c11", "-o", str(binary), str(ROOT / "examples" / "exec" / "c" / "mha.c"), "-lm"],
                   check=True)
    return binary


def _peak_rss_kb(pid: int) -> int | None:
    """A live process's peak resident set (VmHWM, Linux), in KiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def large_child(binary: str, catalog: str) -> None:
    """In a fresh process (its RSS is this measurement's alone): one large case through the transport."""
    from mhaspec.io import safetensors
    from mhaspec.protocol import wire
    from mhaspec.protocol.transports import Program

    from mhaspec.spec import Case
    from mhaspec.spec.catalog import load_catalog_file

    spec = load_catalog_file(catalog)[LARGE["id"]]  # the case's arrays only: no reference is computed here
    case = Case.from_spec(spec, "float32", spec.make_inputs(), spec.make_weights())
    request = len(wire.case_request("run", case)[1])
    transport = Program(f"exec:{shlex.quote(binary)}")
    transport.wait_loaded()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    start = time.perf_counter()
    stages, compute = transport.run(case, timeout=None)
    took = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    reply = sum(v.nbytes for v in stages.values())
    shapes = {k: list(v.shape) for k, v in stages.items()}
    reply_bytes = len(safetensors.encode_parts(stages))
    del stages
    program_peak_kb = _peak_rss_kb(transport._process.pid)
    transport.close()
    print(json.dumps({"request_bytes": request, "reply_bytes": reply_bytes, "stage_bytes": reply,
                      "transport_peak_alloc": peak, "runner_rss_before_kb": rss_before,
                      "runner_rss_peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "program_rss_peak_kb": program_peak_kb,
                      "seconds": took, "compute_seconds": compute, "shapes": shapes}))


def large() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        binary = _build_c(Path(tmp))
        catalog = Path(tmp) / "large.json"
        catalog.write_text(json.dumps([LARGE]))
        done = subprocess.run([sys.executable, __file__, "--large-child", str(binary), str(catalog)],
                              capture_output=True, text=True, check=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    mb = 1 / 2**20
    print(f"  request payload {r['request_bytes'] * mb:.1f} MiB, reply payload {r['reply_bytes'] * mb:.1f} MiB "
          f"(8 stages, float32)")
    print(f"  the transport's peak of new allocations while the case crossed: {r['transport_peak_alloc'] * mb:.1f} MiB "
          f"= {r['transport_peak_alloc'] / r['reply_bytes']:.3f} × the reply payload (1 = the one buffer the arrays view)")
    print(f"  runner peak RSS {r['runner_rss_peak_kb'] / 1024:.0f} MiB (before the case: {r['runner_rss_before_kb'] / 1024:.0f} "
          f"MiB); the program's peak RSS {(r['program_rss_peak_kb'] or 0) / 1024:.0f} MiB")
    print(f"  {r['seconds']:.2f} s for the round trip, of which the program computed {r['compute_seconds']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--large-child", nargs=2, metavar=("BINARY", "CATALOG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.large_child:
        large_child(*args.large_child)
        return
    print(f"mhaspec {mhaspec.__version__} · {os.cpu_count()} CPUs · {time.strftime('%Y-%m-%d')}")
    print("1. per-case overhead, the whole catalog, the numpy computation three ways:")
    overhead(args.repeat)
    if not args.skip_large:
        print("2. one T = S = 2048, d_model = 512, H = 8 float32 case through the C client:")
        large()


if __name__ == "__main__":
    main()
