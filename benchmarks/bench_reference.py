"""Benchmark: the fast float64 reference and the tolerance computation against a plain BLAS forward.

Targets (issue #11), for B = 1, H = 8, T = S = 2048, D = 64 (d_model = 512):
the fast reference (every stage plus the bound of its own error) costs <= 3x a
plain float64 BLAS forward of the same size in the same process, and the
tolerance computation (``stage_tolerances`` for one dtype, with the golden's own error, as the
runner forms it) <= 3x as well: with the compiled chunk loop (numba, the ``fast`` extra;
``MHASPEC_NUMBA=off`` times the NumPy loops).  Also times what
``mhaspec run`` does with such a case: judge a correct result (the golden rounded to the
dtype) in the runner's blocks of query rows, bounds, local checks and comparisons together.
Also prints the exact reference's estimated cost at this size (extrapolated
from a smaller run: it is far too slow to run here).

    python benchmarks/bench_reference.py [--repeat N] [--size T] [--heads H] [--head-dim D]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def plain_forward(config, inputs, weights) -> np.ndarray:
    """The MHA forward in float64 numpy/BLAS, nothing else: the yardstick."""
    q = inputs["query"] @ weights["w_q"] + weights["b_q"]
    k = inputs["key"] @ weights["w_k"] + weights["b_k"]
    v = inputs["value"] @ weights["w_v"] + weights["b_v"]
    B, T, _ = q.shape
    S, H, D = k.shape[1], config.H, config.D_k
    Q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    K = k.reshape(B, S, H, D).transpose(0, 2, 1, 3)
    V = v.reshape(B, S, H, config.D_v).transpose(0, 2, 1, 3)
    s = (Q @ np.swapaxes(K, -1, -2)) * config.scale
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = s @ V
    c = o.transpose(0, 2, 1, 3).reshape(B, T, H * config.D_v)
    return c @ weights["w_o"] + weights["b_o"]


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (as an adapter in that dtype returns it), as float64."""
    if dtype == "bfloat16":
        from mhaspec.conformance.compare import round_to_bfloat16

        return round_to_bfloat16(x)
    return x.astype(dtype).astype(np.float64)


CPU: dict[int, float] = {}  # id(fn) -> best CPU seconds of its runs (all threads of the process)


def best(fn, repeat: int) -> float:
    """Best wall-clock seconds of ``repeat`` runs; the best CPU seconds go to :data:`CPU`."""
    times, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    CPU[id(fn)] = min(cpu)
    return min(times)


def timed(label: str, fn, repeat: int, blas: tuple[float, float] | None = None) -> tuple[float, float]:
    """Print ``label``'s best wall and CPU seconds, and their ratios to ``blas``'s."""
    wall = best(fn, repeat)
    cpu = CPU[id(fn)]
    line = f"{label:<48} wall {wall:8.3f} s  cpu {cpu:8.3f} s"
    if blas is not None:
        line += f"  = {wall / blas[0]:5.2f}x BLAS wall, {cpu / blas[1]:5.2f}x BLAS cpu"
    print(line)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is reported")
    parser.add_argument("--size", type=int, default=2048, help="T = S")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="dtype(s) of the tolerance computation, comma-separated")
    parser.add_argument("--exact", action="store_true", help="also time the exact reference at T=S=128 (~30 s)")
    args = parser.parse_args()

    from mhaspec.conformance import Session
    from mhaspec.conformance.blocks import judge_in_blocks
    from mhaspec.conformance.tolerance import local_references, stage_tolerances
    from mhaspec.reference.onthefly import OnTheFlyGolden
    from mhaspec.spec import Catalog
    from mhaspec.reference.fast import forward_fast
    from mhaspec.reference.onthefly import golden_case
    from mhaspec.spec import CaseSpec, MHAConfig

    H, D, L = args.heads, args.head_dim, args.size
    spec = CaseSpec(id="bench", config=MHAConfig(d_model=H * D, num_heads=H), batch=1, tgt_len=L, src_len=L,
                    inputs="self", seed=1)
    inputs, weights = spec.make_inputs(), spec.make_weights()

    import os

    print(f"B=1 H={H} T=S={L} D={D} d_model={H * D}; best of {args.repeat}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (CPU seconds are the load-independent figure)")
    blas = timed("plain float64 BLAS forward", lambda: plain_forward(spec.config, inputs, weights), args.repeat)
    timed("fast reference (stages + bounds)", lambda: forward_fast(spec.config, inputs, weights), args.repeat, blas)
    if args.exact:  # the exact reference at a small size, extrapolated by its O(B·H·T·S·D) work.
        from mhaspec.reference import forward

        small = 128
        spec_s = spec.model_copy(update={"tgt_len": small, "src_len": small})
        start = time.perf_counter()
        forward(spec.config, spec_s.make_inputs(), spec_s.make_weights())
        exact_small = time.perf_counter() - start
        scale = (L / small) ** 2
        print(f"exact reference (fsum/decimal) at T=S={small}: {exact_small:.2f} s; "
              f"~{exact_small * scale:.0f} s extrapolated to T=S={L} (~{exact_small * scale / blas[0]:.0f}x BLAS)")
    golden = golden_case(spec)
    session = Session("numpy", golden=OnTheFlyGolden(Catalog([spec])), timeout=None, isolate=False)
    from mhaspec.conformance.engine.compiled import kernels_for_shape

    compiled = kernels_for_shape(H, L, L)
    if compiled is None:
        print("tolerance chunk loop: NumPy (numba not installed, or MHASPEC_NUMBA=off)")
    else:
        import numba

        start = time.perf_counter()
        stage_tolerances(golden, args.dtype.split(",")[0], reference_error=True)
        print(f"tolerance chunk loop: compiled (numba {numba.__version__}); its first call, compiling: "
              f"{time.perf_counter() - start:.2f} s (once per process)")
    for dtype in args.dtype.split(","):
        tol = timed(f"golden tolerances ({dtype}, + reference error)",
                    lambda: stage_tolerances(golden, dtype, reference_error=True), args.repeat, blas)
        own = {name: stage.astype(np.float32).astype(np.float64) for name, stage in golden.stages.items()}
        loc = timed(f"local references ({dtype}, every stage exposed)",
                    lambda: local_references(golden, own, dtype), args.repeat, blas)
        print(f"{'tolerance computation in all (' + dtype + ')':<48} wall {tol[0] + loc[0]:8.3f} s  cpu "
              f"{tol[1] + loc[1]:8.3f} s  = {(tol[0] + loc[0]) / blas[0]:5.2f}x BLAS wall, "
              f"{(tol[1] + loc[1]) / blas[1]:5.2f}x BLAS cpu (target <= 3x each)")
        # what `mhaspec run` does with a large case: blocks of query rows, bounds and comparisons
        returned = {name: round_to(stage, dtype) for name, stage in golden.stages.items()}
        verdicts: set[str] = set()
        timed(f"judging a correct result ({dtype}, runner's blocks)",
              lambda: verdicts.update(st.verdict for st in judge_in_blocks(
                  golden, returned, lambda g, r: session.judge_stages(g, dtype, r))), args.repeat, blas)
        print(f"{'':<48} verdicts: {', '.join(sorted(verdicts))}")


if __name__ == "__main__":
    main()
