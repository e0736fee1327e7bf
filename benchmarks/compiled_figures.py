"""The compiled tolerance loop (numba, the ``fast`` extra) against the NumPy loops: the same verdicts.

Every variant of tests/variants.py (correct ones and bugs, every stage exposed and output
only) is judged on on-the-fly cases of more than 2^19 elements per (B, H, T, S) stage (the
compiled loop's threshold lowered to that size for them) in every dtype, once with ``MHASPEC_NUMBA=off`` and once with the compiled
loop.  Prints, per dtype, the correct variants' failures and worst error/tolerance, the
bugs rejected, and every case×dtype whose verdict or first failing stage differs.

    python benchmarks/compiled_figures.py [--size T] [--block-elements N]

``--block-elements N`` judges the cases in blocks of query rows of at most N elements, as
``mhaspec run`` judges cases above 2^22 (mhaspec.conformance.blocks): the compiled loop is
still chosen by the whole case's size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import FAIL, PASS  # noqa: E402
from mhaspec.conformance.engine.compiled import NUMBA_ENV  # noqa: E402
from mhaspec.reference.onthefly import OnTheFlyGolden  # noqa: E402
from mhaspec.spec import DTYPES, CaseSpec, Catalog, MHAConfig  # noqa: E402
from mhaspec.spec.case import MaskSpec  # noqa: E402
from tests.variants import BUGS, CORRECT, OUTPUT_ONLY_BUGS, output_only  # noqa: E402


def cases(size: int) -> list[CaseSpec]:
    return [
        CaseSpec(id="big_causal", config=MHAConfig(d_model=32, num_heads=4, causal=True), batch=2,
                 tgt_len=size, src_len=size, inputs="self", seed=11),
        CaseSpec(id="big_cross_gqa_padding",
                 config=MHAConfig(d_model=24, num_heads=4, num_kv_heads=2, kdim=20, vdim=12),
                 batch=2, tgt_len=size // 2 + 1, src_len=size + 17, inputs="distinct", seed=12,
                 mask=MaskSpec(kind="key_padding", lengths=(size + 17, size // 3))),
        CaseSpec(id="big_large_logits_masked_rows", config=MHAConfig(d_model=16, num_heads=2, bias=False),
                 batch=2, tgt_len=size, src_len=size + 50, inputs="shared_kv", seed=13, input_exponent=2,
                 mask=MaskSpec(kind="random", density=0.5, fully_masked=((0, 5), (0, size - 1)))),
    ]


def judge(adapter, golden, mode: str) -> dict[tuple[str, str], tuple[str, str | None, float]]:
    os.environ[NUMBA_ENV] = mode
    report = mhaspec.check(adapter, golden=golden, timeout=None, isolate=False)
    out = {}
    for r in report.results:
        worst = max((st.worst_ratio or 0.0 for st in r.stages if st.verdict in (PASS, FAIL)), default=0.0)
        out[(r.case, r.dtype)] = (r.verdict, r.first_failing_stage, worst)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=360, help="T = S of the causal case (the others follow)")
    parser.add_argument("--block-elements", type=int, default=None,
                        help="judge in blocks of query rows of at most this many (B, H, T, S) elements")
    args = parser.parse_args()
    if args.block_elements:
        from mhaspec.conformance import blocks

        blocks.MAX_BLOCK_ELEMENTS = args.block_elements
    golden = OnTheFlyGolden(Catalog(cases(args.size)))
    from mhaspec.conformance.engine import compiled

    # cases of a few 10^5 elements keep this run short: the compiled loop's threshold (the size
    # from which it pays back its compilation) is lowered for them; the code path is the same
    compiled.COMPILED_MIN_ELEMENTS = 1 << 19
    for spec in cases(args.size):
        N = spec.batch * spec.config.H
        if compiled.kernels_for_shape(N, spec.tgt_len, spec.src_len) is None:
            raise SystemExit(f"{spec.id}: too small for the compiled loop, or numba is not installed")
    correct = {**{n: v for n, v in CORRECT.items()}, **{f"{n}+output_only": output_only(v) for n, v in CORRECT.items()}}
    bugs = {**{n: v for n, (v, _) in BUGS.items()}, **{n: v for n, (v, _) in OUTPUT_ONLY_BUGS.items()}}
    start = time.perf_counter()
    differ: list[str] = []
    stats = {d: {"correct_fail": [0, 0], "correct_worst": [0.0, 0.0], "bugs": 0, "rejected": [0, 0]} for d in DTYPES}
    for kind, adapters in (("correct", correct), ("bug", bugs)):
        for name, adapter in adapters.items():
            runs = [judge(adapter, golden, mode) for mode in ("off", "on")]
            for key, off in runs[0].items():
                on = runs[1][key]
                dtype = key[1]
                if off[:2] != on[:2]:
                    differ.append(f"{name} {key[0]}/{dtype}: {off[:2]} vs {on[:2]}")
                for i, res in enumerate((off, on)):
                    if kind == "correct":
                        stats[dtype]["correct_fail"][i] += res[0] != PASS
                        stats[dtype]["correct_worst"][i] = max(stats[dtype]["correct_worst"][i], res[2])
                    else:
                        stats[dtype]["rejected"][i] += res[0] == FAIL
                if kind == "bug":
                    stats[dtype]["bugs"] += 1
    os.environ.pop(NUMBA_ENV, None)
    print(f"{len(correct)} correct and {len(bugs)} buggy variants x {len(cases(args.size))} large cases x 4 dtypes, "
          f"NumPy loops (off) and compiled loop (on)"
          f"{f', in blocks of <= {args.block_elements} elements' if args.block_elements else ''}; "
          f"{time.perf_counter() - start:.0f} s")
    print(f"{'dtype':<9} correct failing off/on   correct worst ratio off/on   bugs failing off/on (of every bug × case, "
          "some of which a case cannot show)")
    for d in DTYPES:
        s = stats[d]
        print(f"{d:<9} {s['correct_fail'][0]:>10} / {s['correct_fail'][1]:<8} {s['correct_worst'][0]:>14.4f} / "
              f"{s['correct_worst'][1]:<10.4f} {s['rejected'][0]:>8}/{s['bugs']} / {s['rejected'][1]}/{s['bugs']}")
    print(f"case×dtype whose verdict or first failing stage differs: {len(differ)}")
    for line in differ:
        print("  " + line)


if __name__ == "__main__":
    main()
