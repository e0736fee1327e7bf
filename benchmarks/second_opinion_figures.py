"""The figures behind docs/tolerances.md, "The same-precision second opinion", both sides, per dtype.

* correct implementations (tests/variants.py CORRECT, every stage exposed and output only) over
  the whole catalog: the largest second-opinion ratio (RMS error / the plain implementations'),
  against C, and what it would be with the spec's order of the scale alone (``scale-after``);
* bugs (BUGS and OUTPUT_ONLY_BUGS, where the bug changes the float64 result): the share the
  suite rejects with the second opinion and without it (a case whose only failing check is the
  second opinion is not rejected without it);
* a float32 kernel that exposes only ``output`` with its scale off by 1e-3 and 1e-4 relative at
  T = S = 1024 (d_model 512, H = 8, computed on the fly): its element-wise ratios and its
  second-opinion ratio; and the seconds the second opinion adds to judging that case.

    python benchmarks/second_opinion_figures.py [--skip-zoo] [--skip-large]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.conformance import ERROR, FAIL  # noqa: E402
from mhaspec.conformance import second_opinion  # noqa: E402
from mhaspec.conformance.blocks import MAX_BLOCK_ELEMENTS, _blocks, _slice_stage, block_case  # noqa: E402
from mhaspec.adapters.numpy_mha import NumpyMHA  # noqa: E402
from mhaspec.conformance.judging import judging_block  # noqa: E402
from mhaspec.reference.onthefly import OnTheFlyGolden  # noqa: E402
from mhaspec.spec import DTYPES, Catalog, CaseSpec  # noqa: E402
from tests.test_second_opinion import ScaleOff  # noqa: E402
from tests.variants import BUGS, CORRECT, OUTPUT_ONLY_BUGS, output_only  # noqa: E402
from tests.zoo import applies, visible_cases  # noqa: E402


def spec_order_alone(so: second_opinion.SecondOpinion) -> float:
    """The ratio had the plain implementation been the spec's order alone."""
    ref = max(math.sqrt(so.plain_ss["scale-after"] / so.compared), so.floor_rms)
    return so.adapter_rms / ref if ref > 0 else 0.0


def caught_without(r) -> bool:
    """Whether a case result is rejected by the element-wise checks alone."""
    if r.verdict == ERROR:
        return True
    return any(st.verdict == FAIL and st.failed_check != "second_opinion" for st in r.stages)


def correct_figures() -> None:
    print("\n== correct implementations (tests/variants.py CORRECT, all stages and output only), whole catalog ==")
    worst = {d: (0.0, "") for d in DTYPES}
    alone = {d: 0.0 for d in DTYPES}
    so_fail = {d: 0 for d in DTYPES}
    adapters = list(CORRECT.values()) + [output_only(v) for v in CORRECT.values()]
    for adapter in adapters:
        for r in mhaspec.check(adapter, timeout=None, isolate=False).results:
            for st in r.stages:
                so = st.second_opinion
                if so is None or not so.judged:
                    continue
                if so.ratio > worst[r.dtype][0]:
                    worst[r.dtype] = (so.ratio, f"{adapter.name}{'+output_only' if adapter.output_only else ''} "
                                                f"{r.case}:{st.stage} (plain order {so.order})")
                alone[r.dtype] = max(alone[r.dtype], spec_order_alone(so))
                so_fail[r.dtype] += "second_opinion" in st.failed_check
    print(f"{len(adapters)} implementations; C = {second_opinion.C:g}")
    print(f"{'dtype':<9} {'largest ratio':>13}  {'(spec order alone)':>18}  second-opinion failures  where")
    for d in DTYPES:
        print(f"{d:<9} {worst[d][0]:>13.3g}  {alone[d]:>18.3g}  {so_fail[d]:>23}  {worst[d][1]}")


def bug_figures() -> None:
    print("\n== bugs rejected where they change the float64 result (BUGS + OUTPUT_ONLY_BUGS) ==")
    totals = {d: [0, 0, 0] for d in DTYPES}
    only: list[str] = []
    missed: list[str] = []
    for name, (adapter, _) in {**BUGS, **OUTPUT_ONLY_BUGS}.items():
        visible = visible_cases(adapter)
        for r in mhaspec.check(adapter, timeout=None, isolate=False).results:
            if r.case in visible and applies(adapter, r.dtype):
                caught = r.verdict in (FAIL, ERROR)
                before = caught_without(r)
                totals[r.dtype][0] += caught
                totals[r.dtype][1] += before
                totals[r.dtype][2] += 1
                if caught and not before:
                    only.append(f"{name} on {r.case} [{r.dtype}]")
                if not caught:
                    missed.append(f"{name} on {r.case} [{r.dtype}]")
    print(f"{'dtype':<9} {'with it':>9}  {'without':>9}  of")
    for d, (c, b, n) in totals.items():
        print(f"{d:<9} {c:>9}  {b:>9}  {n}  ({c / n:.1%} vs {b / n:.1%})")
    print("caught by the second opinion alone: " + ("; ".join(only) if only else "none"))
    shown = missed if len(missed) <= 12 else missed[:12] + [f"… {len(missed) - 12} more"]
    print("not rejected: " + ("; ".join(shown) if shown else "none"))


def large_figures() -> None:
    size = 1024
    spec = {"id": f"d512_h8_t{size}", "config": {"d_model": 512, "num_heads": 8}, "batch": 1,
            "tgt_len": size, "src_len": size, "inputs": "self", "seed": 1}
    golden_set = OnTheFlyGolden(Catalog([CaseSpec.model_validate(spec)]))
    print(f"\n== a float32 kernel exposing only output, scale off, at T = S = {size} (d_model 512, H = 8) ==")
    for rel in (0.0, 1e-4, 1e-3):
        rep = mhaspec.check(ScaleOff(rel), dtypes=["float32"], golden=golden_set, timeout=None, isolate=False)
        st = rep.results[0].stage("output")
        so = st.second_opinion
        print(f"scale x (1 + {rel:g}): verdict {st.verdict:<5} element-wise worst {st.worst_ratio:.3g}, rms "
              f"{st.rms_ratio:.3g}; second opinion {so.ratio:.4g}x the plain error ({so.adapter_rms:.3g} vs "
              f"{so.reference_rms:.3g}, order {so.order}), failed_check {st.failed_check or '-'}")
    golden = golden_set.load(spec["id"])
    blocks = _blocks(golden, MAX_BLOCK_ELEMENTS) or [(0, 0, size)]
    for dtype in ("float32", "float16"):
        returned = NumpyMHA().run(golden.case(dtype))
        for stages in (("output",), tuple(returned)):
            own = {k: np.asarray(returned[k], dtype=np.float64) for k in stages}
            memo: dict = {}
            start, cpu = time.perf_counter(), time.process_time()
            for b, t0, t1 in blocks:
                with judging_block(block_case(golden, b, t0, t1), golden, memo) as block:
                    second_opinion.judge(block, dtype, {k: _slice_stage(k, v, b, t0, t1) for k, v in own.items()})
            print(f"the second opinion of that case in {dtype}, {len(stages)} stage(s) returned, {len(blocks)} blocks: "
                  f"{time.perf_counter() - start:.2f} s wall, {time.process_time() - cpu:.2f} s CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-zoo", action="store_true")
    parser.add_argument("--skip-large", action="store_true")
    args = parser.parse_args()
    if not args.skip_zoo:
        correct_figures()
        bug_figures()
    if not args.skip_large:
        large_figures()


if __name__ == "__main__":
    main()
