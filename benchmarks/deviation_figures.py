"""Figures: a declared deviation bounded by ``within`` hides no bug; an unbounded one hides them.

The adapter under test takes the scale in float32 whatever the dtype — what Keras and the
ONNX exporters do in float64, declared there as a known deviation — on top of each
realistic bug of tests/variants.py (every stage exposed, and output only).  Three ways:

* ``no deviation``: the bug alone (no float32 scale, nothing declared): the reference rates;
* ``within float32``: float32 scale + ``Deviation(dtype="float64", within="float32")``;
* ``unbounded``: float32 scale + the same deviation without ``within`` (before it existed).

Per dtype, the share of case × dtype rejected (fail or error) where the bug changes the
float64 result.  Then the same for the backward bugs of tests/backward_variants.py (the
float32 scale in the forward and the backward, declared for every float64 stage), counted
where the bug alone is rejected.  Also checks that the correct implementations with the
float32 scale conform under the bounded declaration.

    python benchmarks/deviation_figures.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mhaspec  # noqa: E402
from mhaspec.adapters import Deviation  # noqa: E402
from mhaspec.conformance import ERROR, FAIL  # noqa: E402
from mhaspec.spec import DTYPES  # noqa: E402
from tests.backward_variants import BUGS as BACKWARD_BUGS  # noqa: E402
from tests.test_deviations import Declared, DeclaredBackward  # noqa: E402  (the adapter with declarations)
from tests.variants import BUGS, CORRECT, OUTPUT_ONLY_BUGS  # noqa: E402
from tests.zoo import applies, visible_cases  # noqa: E402

REASON = "the scale is taken in float32 (test)"


def caught(adapter, variant) -> dict[str, tuple[int, int]]:
    """(rejected, counted) per dtype, counted where ``variant``'s bug changes the float64 result."""
    visible = visible_cases(variant)
    report = mhaspec.check(adapter, timeout=None)
    out = {d: [0, 0] for d in DTYPES}
    for r in report.results:
        if r.case in visible and applies(variant, r.dtype):
            out[r.dtype][0] += r.verdict in (FAIL, ERROR)
            out[r.dtype][1] += 1
    return out


def main() -> None:
    bounded = [Deviation(REASON, dtype="float64", within="float32")]
    unbounded = [Deviation(REASON, dtype="float64")]
    for name, variant in sorted(CORRECT.items()):
        report = mhaspec.check(Declared(replace(variant, scale_float32=True), bounded), timeout=None)
        assert report.ok, f"{name} with a float32 scale does not conform under the bounded deviation"
    print(f"correct implementations with a float32 scale, bounded deviation: all {len(CORRECT)} conform")
    totals = {way: {d: [0, 0] for d in DTYPES} for way in ("no deviation", "within float32", "unbounded")}
    for name, (variant, _) in sorted({**BUGS, **OUTPUT_ONLY_BUGS}.items()):
        deviating = replace(variant, scale_float32=True)
        for way, adapter in (("no deviation", variant), ("within float32", Declared(deviating, bounded)),
                             ("unbounded", Declared(deviating, unbounded))):
            for d, (c, n) in caught(adapter, variant).items():  # counted where the bug itself shows
                totals[way][d][0] += c
                totals[way][d][1] += n
        print(f"  {name}: done", file=sys.stderr)
    print("bugs rejected where they change the float64 result (all bugs, full and output-only):")
    for way, per in totals.items():
        print(f"  {way:<15} " + ", ".join(f"{d} {c}/{n} = {c / n:.1%}" for d, (c, n) in per.items()))

    # backward: the same float32 scale (forward and backward stages) on each backward bug, counted on
    # the case × dtype where the bug alone is rejected
    back = {way: {d: [0, 0] for d in DTYPES} for way in ("within float32", "unbounded")}
    for name, (variant, _) in sorted(BACKWARD_BUGS.items()):
        alone = {(r.case, r.dtype) for r in mhaspec.check(variant, timeout=None, backward=True).results
                 if r.verdict in (FAIL, ERROR)}
        deviating = replace(variant, name=variant.name + "+scale_f32", scale_float32=True)
        for way, declared in (("within float32", bounded), ("unbounded", unbounded)):
            report = mhaspec.check(DeclaredBackward(deviating, declared), timeout=None, backward=True)
            for r in report.results:
                if (r.case, r.dtype) in alone:
                    back[way][r.dtype][0] += r.verdict in (FAIL, ERROR)
                    back[way][r.dtype][1] += 1
        print(f"  backward {name}: done", file=sys.stderr)
    print(f"backward bugs ({len(BACKWARD_BUGS)}), with a float32 scale, rejected where the bug alone is:")
    for way, per in back.items():
        print(f"  {way:<15} " + ", ".join(f"{d} {c}/{n} = {c / n:.1%}" for d, (c, n) in per.items()))


if __name__ == "__main__":
    main()
