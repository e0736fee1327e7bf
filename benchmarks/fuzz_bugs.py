"""Benchmark: how many random configurations `mhaspec fuzz` needs to find each bug of the zoo.

Target (issue #11): every buggy variant in tests/variants.py that a random
configuration can express is found within 100 examples and shrunk.  Prints, per
bug, the examples drawn until the first failure (seed 0, float32), the shrunk
configuration and its first failing stage against the one the zoo names.

    python benchmarks/fuzz_bugs.py [--examples 100] [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mhaspec.fuzz import fuzz  # noqa: E402
from tests.variants import BUGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    found = 0
    for name, (adapter, stage) in sorted(BUGS.items()):
        start = time.perf_counter()
        outcome = fuzz(adapter, examples=args.examples, seed=args.seed, dtypes=[args.dtype])
        seconds = time.perf_counter() - start
        if not outcome.found:
            print(f"{name:<34} NOT FOUND in {args.examples} examples ({seconds:.0f} s)", flush=True)
            continue
        found += 1
        spec = outcome.spec
        cfg = spec.config
        first = outcome.results[0].first_failing_stage
        print(f"{name:<34} found after {outcome.examples:>3} examples ({seconds:4.0f} s); shrunk to B={spec.batch} "
              f"T={spec.tgt_len} S={spec.src_len} d_model={cfg.d_model} H={cfg.H} H_kv={cfg.H_kv} "
              f"causal={cfg.causal} mask={'yes' if spec.mask is not None else 'no'}; first failing stage {first}"
              f"{'' if first == stage else f' (zoo: {stage})'}", flush=True)
    print(f"found {found}/{len(BUGS)} within {args.examples} examples")


if __name__ == "__main__":
    main()
