"""Benchmark: the smallest gradient error the backward check catches, per dtype (docs/backward.md).

For each stage, the numpy adapter's gradient is scaled by 1 + ε (ε = 2^-2 … 2^-15)
and judged on the whole catalog; printed is the smallest ε that fails at least
half of the cases, under the current golden bound (noise model) and under the
full-size propagation of every error (``backward_tolerances``, the previous
standard bound and still the worst-case contract's form).  By default the adapter
exposes only what an autograd framework gives (``output`` and the input, weight
and bias gradients); ``--all-stages`` exposes every stage (the local checks then
locate such errors on their own).

    python benchmarks/backward_sensitivity.py [--all-stages] [--dtypes float32,float16,bfloat16]
"""

from __future__ import annotations

import argparse

import numpy as np

import mhaspec
from mhaspec.adapters import load_adapter
from mhaspec.conformance import backward as judge_module
from mhaspec.conformance import runner as runner_module
from mhaspec.conformance import tolerance as tb
from mhaspec.conformance.tolerance import Bound
from mhaspec.spec.tolerance import DEFAULT_TOLERANCES

USER_FACING = ("d_query", "d_key", "d_value", "d_w_q", "d_w_k", "d_w_v", "d_w_o", "d_b_q", "d_b_k", "d_b_v", "d_b_o")


def full_size(golden, dtype, forward=None, table=DEFAULT_TOLERANCES, precision="standard"):
    return {k: Bound(np.zeros_like(v), v) for k, v in tb.backward_tolerances(golden, dtype, table=table,
                                                                             precision=precision).items()}


class Scaled:
    """The numpy adapter with one backward stage scaled by 1 + eps."""

    name = "scaled"

    def __init__(self, base, stage: str, eps: float, all_stages: bool) -> None:
        self.base, self.stage, self.eps, self.all = base, stage, eps, all_stages

    def run(self, case):
        out = self.base.run(case)
        return out if self.all else {"output": out["output"]}

    def backward(self, case):
        out = {k: v for k, v in self.base.backward(case).items() if self.all or k in USER_FACING}
        x = np.asarray(out[self.stage])
        out[self.stage] = (x.astype(np.float64) * (1 + self.eps)).astype(x.dtype)
        return out


def smallest(base, stage: str, dtype: str, all_stages: bool) -> str:
    found = None
    for k in range(2, 16):
        report = mhaspec.check(Scaled(base, stage, 2.0**-k, all_stages), dtypes=[dtype], backward=True,
                               isolate=False, timeout=None)
        judged = [r for r in report.results if r.verdict != "unsupported" and
                  any(st.stage == stage and st.verdict != "not exposed" for st in r.stages)]
        if not judged or np.mean([r.verdict == "fail" for r in judged]) < 0.5:
            break
        found = k
    return f"2^-{found}" if found else "> 2^-2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-stages", action="store_true")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--stages", default="d_w_q,d_w_v,d_w_o,d_query,d_b_v")
    args = parser.parse_args()
    base = load_adapter("numpy")
    dtypes = args.dtypes.split(",")
    current = tb.backward_bounds
    print(f"smallest ε with d_stage·(1 + ε) failing ≥ half the cases ({'every stage' if args.all_stages else 'user-facing gradients only'} exposed)")
    print(f"{'stage':<10} {'bound':<22} " + " ".join(f"{d:>10}" for d in dtypes))
    for stage in args.stages.split(","):
        for label, fn in (("full-size propagation", full_size), ("noise model (now)", current)):
            judge_module.backward_bounds = runner_module.backward_bounds = fn
            cells = [smallest(base, stage, d, args.all_stages) for d in dtypes]
            print(f"{stage:<10} {label:<22} " + " ".join(f"{c:>10}" for c in cells), flush=True)
    judge_module.backward_bounds = runner_module.backward_bounds = current


if __name__ == "__main__":
    main()
