"""Benchmark: the compiled library's loops (engine/native.py) against numba's and the NumPy loops.

Prints (1) the golden bounds' attention loop alone on one chunk of 2^18 elements (8 heads, 32 rows,
S = 1024; a causal visibility broadcast over the heads, as in a run, then contiguous), numba's loop,
the library's and the library's that also forms the golden lse's row operands (mh_attention_lse_chunk),
thread CPU per element, alternating; (2) the thread CPU inside the golden bounds' chunk
functions (the library's path with its float32 products, chunks of 2^18, against the NumPy loops,
chunks of 2^16; one thread; best of 3 alternating rounds) of a causal d_model 512, H = 8 case by size,
from which ``compiled.NATIVE_MIN_ELEMENTS`` is judged (benchmarks/results/2026-12-07-s5-attn.md); and first
(0) each loop of local.c and stage.c at every x86-64 level the processor runs (baseline, AVX2, AVX-512), thread
CPU per element on one chunk of 2^18 elements (results/2026-12-07-s5-levels.md).

    python benchmarks/bench_native.py [--sizes 8,16,32,64,128] [--levels]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def loop_alone() -> None:
    from test_native import _call, _chunk, _outputs  # the tests' inputs of one chunk

    from mhaspec.conformance.engine import native

    try:
        from mhaspec.conformance.engine import kernels
    except ImportError:
        kernels = None
    rng = np.random.default_rng(1)
    s, p, _, m1, m2, c = _chunk(rng, heads=8, rows=32, S=1024, masked=0.0)
    causal = np.broadcast_to(np.tril(np.ones((32, 1024), bool), 900)[None], s.shape)
    with_lse = _WithLse(native, s.shape[:-1]) if native.attention_lse_chunk is not None else None
    names = {id(kernels): "numba", id(native): "library", id(with_lse): "library with the lse"}
    for label, vis in (("broadcast visibility", causal), ("contiguous visibility", np.ascontiguousarray(causal))):
        for impl in [x for x in (kernels, native, with_lse) if x is not None] * 2:
            out = _outputs(s.shape, 1024)
            _call(impl, s, p, vis, m1, m2, c, out, ext=(1e-12, 1e-12))  # numba: compiled here, not timed
            start = time.thread_time()
            for _ in range(20):
                _call(impl, s, p, vis, m1, m2, c, out, ext=(1e-12, 1e-12))
            spent = (time.thread_time() - start) / 20 / s.size
            print(f"attention loop, {label}, {names[id(impl)]}: {spent * 1e9:.2f} ns/element")


class _WithLse:
    """``native`` with its attention loop called as the one that also forms the golden lse's row operands."""

    def __init__(self, native, rows_shape):
        self.native, self.rows = native, np.zeros((*rows_shape, 5))

    def call(self, name, *args):
        return self.native.call("attention_lse_chunk", *args, self.rows)


def _level_inputs() -> dict[str, tuple]:
    """Each level-built loop's arguments on one chunk of 2^18 elements (8 heads, 32 rows, S = 1024; a causal
    visibility broadcast over the heads, scores of a float32 case's magnitudes, a passing stage)."""
    from test_native_stage import _args, _stage

    rng = np.random.default_rng(2)
    n, R, S = 8, 32, 1024
    s = rng.standard_normal((n, R, S)) * 3
    vis = np.broadcast_to(np.tril(np.ones((R, S), bool), 900)[None], s.shape)
    weights = (s, vis, 2.0**-48, 2.0**-24 * 1.5, 3e-7, 1e-7, 1e-30, np.zeros(s.shape), np.zeros(s.shape),
               np.zeros(s.shape), np.zeros((8, S)), 933)
    m_sig, m_wor = (np.abs(rng.standard_normal((n, R, 64))).astype(np.float32) for _ in range(2))
    p = np.abs(s) / np.abs(s).sum(axis=-1, keepdims=True)
    stage = _stage(3, (n, R, S))
    g = stage["g"]
    return {"exp_array": (s.ravel(),),
            "local_weights_chunk": weights,
            "local_weights_lse_chunk": (*weights, np.zeros((n, R, 7))),
            "local_scores_chunk": (s.copy(), m_sig, m_wor, 0.125, 3e-15, 2**-47, 2e-7, 1e-8, 1e-30,
                                   np.ones(s.shape), np.ones(s.shape), 64),
            "local_outputs_operands": (p, np.empty(s.shape, np.float32), np.empty(s.shape, np.float32)),
            "ordinary_stage": _args(stage),
            "sum_squares": (stage["v"], g, stage["vis"], True, True),
            "sum_squares_f4": (stage["v"].astype(np.float32), g, stage["vis"], True, True)}


def levels() -> None:
    """Each loop that local.c and stage.c build per x86-64 level (csrc/common.h, MH_LEVEL), at every level
    this processor runs: thread CPU per element, best of 3 alternating rounds of 10 calls."""
    from mhaspec.conformance.engine import native

    best: dict[tuple[str, str], float] = {}
    for name, args in _level_inputs().items():
        elements = args[0].size
        for _ in range(3):
            for level in native.supported_levels():
                loop = ((lambda x, level=level: native._exp_array(x, level)) if name == "exp_array"
                        else native._kernel(name, level))
                loop(*args)
                start = time.thread_time()
                for _ in range(10):
                    loop(*args)
                spent = (time.thread_time() - start) / 10 / elements
                best[name, level] = min(best.get((name, level), np.inf), spent)
        print(f"{name}: " + ", ".join(f"{level} {best[name, level] * 1e9:.2f}" for level in native.supported_levels())
              + " ns/element")


def chunk_functions(sizes: list[int]) -> None:
    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks, compiled, inplace
    from mhaspec.reference.onthefly import golden_case
    from mhaspec.spec import CaseSpec, MHAConfig

    spent = {"native": 0.0, "numpy": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.thread_time() - start
        return wrapper

    compiled.attention_chunk = timed(compiled.attention_chunk, "native")
    inplace.attention_chunk = timed(inplace.attention_chunk, "numpy")
    chunks.MAX_THREADS = 1
    for L in sizes:
        spec = CaseSpec(id="t", config=MHAConfig(d_model=512, num_heads=8, causal=True), batch=1, tgt_len=L,
                        src_len=L, inputs="self", seed=1)
        golden = golden_case(spec)
        reps = min(40, max(2, (1 << 23) // (8 * L * L)))
        best: dict[str, float] = {}
        for _ in range(3):
            for mode in ("numpy", "native"):
                os.environ["MHASPEC_LOOPS"] = mode
                spent[mode] = 0.0
                for _ in range(reps):
                    tol.judging_bounds(golden, "float32")
                best[mode] = min(best.get(mode, np.inf), spent[mode] / reps)
        n = 8 * L * L
        print(f"chunk functions, T = S = {L} (2^{np.log2(n):.0f} elements): NumPy loops {best['numpy'] * 1e3:.3f} ms, "
              f"library {best['native'] * 1e3:.3f} ms, {(best['numpy'] - best['native']) / n * 1e9:.1f} ns/element less")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64,128")
    parser.add_argument("--levels", action="store_true", help="only the per-level loops (local.c, stage.c)")
    args = parser.parse_args()
    levels()
    if args.levels:
        return
    loop_alone()
    chunk_functions([int(x) for x in args.sizes.split(",")])


if __name__ == "__main__":
    main()
