"""Benchmark: what speaking mhaspec-wire/1 to a program (``exec:``) costs (docs/protocol.md §8).

1. **Per-case overhead on the catalog** (28 cases × 4 dtypes).  (a) What the protocol itself costs:
   each case sent through a transport and its stages read back, the round trip's time minus the
   compute time the adapter reports, for mhaspec's Python worker (the ``numpy`` adapter), the C
   client of examples/exec/c and tests/exec_client.py (a Python program that frames its messages by
   hand); no judging.  (b) The whole catalog judged by ``mhaspec.check``: numpy in this process
   (``isolate=False``), numpy in its worker, the C client.  Each runs ``--repeat`` times; the
   fastest counts.
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


def _round_trips(transport, cases) -> list[float]:
    """Per case×dtype: the round trip's seconds minus the seconds the adapter said it computed."""
    out = []
    for case in cases:
        start = time.perf_counter()
        _, computed = transport.run(case, timeout=None)
        out.append(time.perf_counter() - start - computed)
    return out


def overhead(repeat: int, binary: Path) -> None:
    from mhaspec.fixtures import GoldenSet
    from mhaspec.protocol.transports import Program, Worker
    from mhaspec.spec import DTYPES

    golden = GoldenSet()
    cases = [golden.load(c).case(d) for c in golden.ids() for d in DTYPES]
    python_client = f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(CLIENT))}"
    print(f"  a. the protocol's own cost per case×dtype (round trip minus the adapter's compute time, "
          f"{len(cases)} case×dtype, best of {repeat}, no judging):")
    for label, make in [("mhaspec's Python worker (numpy)", lambda: Worker("numpy")),
                        ("the C client (exec:)", lambda: Program(f"exec:{shlex.quote(str(binary))}")),
                        ("the Python client (exec:)", lambda: Program(python_client))]:
        best = None
        for _ in range(repeat):
            transport = make()
            transport.wait_loaded()
            trips = sorted(_round_trips(transport, cases))
            transport.close()
            if best is None or sum(trips) < sum(best):
                best = trips
        median, mean = best[len(best) // 2], sum(best) / len(best)
        print(f"     {label:<34} median {1000 * median:5.2f} ms, mean {1000 * mean:5.2f} ms, max {1000 * best[-1]:5.1f} ms")
    print(f"  b. the whole catalog judged (mhaspec.check, every stage judged; best of {repeat}):")
    ways = {
        "numpy, in this process (isolate=False)": lambda: mhaspec.check(NumpyMHA(), isolate=False, timeout=None),
        "numpy, mhaspec's Python worker": lambda: mhaspec.check("numpy", timeout=None),
        "the C client (exec:)": lambda: mhaspec.check(f"exec:{shlex.quote(str(binary))}", timeout=None),
    }
    for label, run in ways.items():
        seconds, count = _best(run, repeat)
        print(f"     {label:<38} {seconds:6.2f} s   {1000 * seconds / count:6.1f} ms per case×dtype")


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


def large(binary: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
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
    print(f"mhaspec {mhaspec.__version__} · {os.cpu_count()} CPUs · load average {os.getloadavg()[0]:.2f} · "
          f"{time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory() as tmp:
        binary = _build_c(Path(tmp))
        print("1. per-case overhead on the catalog:")
        overhead(args.repeat, binary)
        if not args.skip_large:
            print("2. one T = S = 2048, d_model = 512, H = 8 float32 case through the C client:")
            large(binary)


if __name__ == "__main__":
    main()
