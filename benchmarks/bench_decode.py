"""Benchmark: 1 prefill row + 255 decode steps at d_model 512, H 8, judged call by call (issue 32).

One case (self-attention, causal bottom-right, B = 1, T = S = 256, d_model 512, H 8, D_k = D_v = 64,
schedule [1] + [1] * 255: 256 calls against the adapter's KV cache), written to a catalog file and
run by ``mhaspec run numpy --catalog FILE --dtype float32`` in a fresh process.  Prints the wall time,
the CPU time of that process and the machine's load average before and after (the machine may be
shared); target: judged in < 60 s.  ``--profile`` also runs it in this process under cProfile and
prints where the time goes.  ``--page-size N``: the same case with a paged cache of N-key pages (its block
table drawn from the seed; docs/serving.md "Paged caches").

    python benchmarks/bench_decode.py [--dtype float32] [--steps 255] [--page-size N] [--profile]
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

TARGET_S = 60.0


def decode_case(steps: int, page_size: int | None = None) -> dict:
    """The case: a prefill of one row, then ``steps`` single-row decode steps (T = S = steps + 1); with
    ``page_size``, its cache paged."""
    rows = steps + 1
    paged = {} if page_size is None else {"page_size": page_size}
    return {"id": f"decode_1_plus_{steps}", "description": f"1 prefill row + {steps} decode steps, d_model 512, H 8",
            "config": {"d_model": 512, "num_heads": 8, "causal": True, "causal_alignment": "bottom_right"},
            "batch": 1, "tgt_len": rows, "src_len": rows, "inputs": "self", "seed": 32,
            "schedule": [1] * rows, **paged}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=255)
    parser.add_argument("--page-size", type=int, default=None, help="a paged cache of this many keys per page")
    parser.add_argument("--profile", action="store_true", help="also profile the run in this process")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        catalog = Path(tmp) / "decode_bench.json"
        catalog.write_text(json.dumps({"cases": [decode_case(args.steps, args.page_size)]}), encoding="utf-8")
        command = [sys.executable, "-m", "mhaspec", "run", "numpy", "--catalog", str(catalog), "--dtype", args.dtype]
        load_before = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(proc.stdout[-3000:])
        if proc.returncode != 0:
            sys.exit(f"`mhaspec run numpy --catalog ... --dtype {args.dtype}` exited {proc.returncode}:\n"
                     f"{proc.stderr[-3000:]}")
        paged = "" if args.page_size is None else f", paged ({args.page_size}-key pages)"
        print(f"1 prefill + {args.steps} decode steps, d_model 512, H 8, {args.dtype}{paged}: "
              f"wall {wall:.1f} s, CPU {cpu:.1f} s (target < {TARGET_S:.0f} s: "
              f"{'met' if wall < TARGET_S else 'NOT met'}); load average {load_before[0]:.2f} before, "
              f"{load_after[0]:.2f} after, {os.cpu_count()} CPUs")
        if args.profile:
            profile(catalog, args.dtype)


def profile(catalog: Path, dtype: str) -> None:
    """The same run in this process under cProfile: the 25 functions with the most cumulative time."""
    import cProfile
    import pstats

    import mhaspec
    from mhaspec.reference.onthefly import OnTheFlyGolden

    golden = OnTheFlyGolden(str(catalog))  # as `run --catalog` computes it
    profiler = cProfile.Profile()
    profiler.enable()
    mhaspec.check("numpy", golden=golden, dtypes=[dtype], isolate=False, timeout=None)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
