"""A declared deviation bounded by ``within`` excuses the deviation, never a bug at the same stage.

The adapter under test takes the scale in float32 whatever the dtype (what Keras and the ONNX
exporters do in float64; declared there ``within="float32"``), or accumulates in the dtype itself
(declared ``within="worst-case"``).  On top of it, realistic bugs of tests/variants.py must be
rejected on exactly the case × dtype where they are rejected without any deviation — in every
dtype — while an unbounded declaration hides them in the dtype it covers.
benchmarks/deviation_figures.py prints the same over every bug.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import mhaspec
from mhaspec.adapters import Deviation
from mhaspec.conformance import ERROR, FAIL, KNOWN_DEVIATION, PASS
from mhaspec.spec import DTYPES

from .backward_variants import BUGS as BACKWARD_BUGS
from .backward_variants import CORRECT as BACKWARD_CORRECT
from .reports import report_of
from .variants import BUGS, NATIVE, OUTPUT_ONLY_BUGS, Variant
from .zoo import visible_cases

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

SCALE_F32 = "the scale is taken in float32 (test)"


class Declared:
    """``variant`` with ``known_deviations``."""

    def __init__(self, variant: Variant, deviations: list[Deviation]) -> None:
        self.variant, self.name, self.known_deviations = variant, variant.name, deviations

    def run(self, case):
        return self.variant.run(case)


class DeclaredBackward(Declared):
    """The same, with the variant's backward."""

    def backward(self, case):
        return self.variant.backward(case)


def rejected(report) -> set[tuple[str, str]]:
    return {(r.case, r.dtype) for r in report.results if r.verdict in (FAIL, ERROR)}


def test_a_bounded_deviation_excuses_what_it_declares():
    honest = Declared(Variant(name="scale_f32", scale_float32=True),
                      [Deviation(SCALE_F32, dtype="float64", within="float32")])
    report = mhaspec.check(honest, timeout=None)
    assert report.ok, report.table()
    deviating = {(r.case, r.dtype) for r in report.results if r.verdict == KNOWN_DEVIATION}
    assert deviating and {d for _, d in deviating} == {"float64"}
    assert all(r.verdict == PASS for r in report.results if r.dtype != "float64")
    # without the declaration the same adapter fails in float64: the declaration is what excuses it
    assert {(r.case, r.dtype) for r in mhaspec.check(honest.variant, timeout=None).results
            if r.verdict == FAIL} == deviating


@pytest.mark.parametrize("bug", ["output_bias_dropped", "causal_off_by_one", "softmax_over_queries+output_only"])
def test_a_bug_beyond_a_bounded_deviation_fails_in_every_dtype(bug: str):
    variant, stage = {**BUGS, **OUTPUT_ONLY_BUGS}[bug]
    visible = visible_cases(variant)
    alone = rejected(report_of(variant)) & {(c, d) for c in visible for d in DTYPES}
    assert {d for _, d in alone} == set(DTYPES), "the bug alone is rejected in every dtype"
    deviating = replace(variant, scale_float32=True)
    bounded = mhaspec.check(Declared(deviating, [Deviation(SCALE_F32, dtype="float64", within="float32")]),
                            timeout=None)
    assert rejected(bounded) & {(c, d) for c in visible for d in DTYPES} == alone
    float64 = [r for r in bounded.results if r.dtype == "float64" and (r.case, r.dtype) in alone]
    assert all(r.first_failing_stage == stage for r in float64)
    beyond = [r.stage(stage).message for r in float64]
    assert any("beyond its declared deviation (*/float64/* (within: float32))" in m for m in beyond), beyond
    # the same declaration without ``within`` hides the bug in float64 (why the bound exists)
    unbounded = mhaspec.check(Declared(deviating, [Deviation(SCALE_F32, dtype="float64")]), timeout=None)
    assert not {d for _, d in rejected(unbounded) & alone} & {"float64"}


def test_a_worst_case_bound_excuses_native_accumulation_but_not_a_bug_on_top():
    native = NATIVE["native_low_precision_accumulation"]
    declared = [Deviation("sums accumulated in the dtype (test)", dtype=d, within="worst-case")
                for d in ("float16", "bfloat16")]
    report = mhaspec.check(Declared(native, declared), timeout=None)
    assert report.ok, report.table()
    assert {r.dtype for r in report.results if r.verdict == KNOWN_DEVIATION} == {"float16", "bfloat16"}
    buggy = replace(native, name="native+no_b_o", drop_output_bias=True)
    report = mhaspec.check(Declared(buggy, declared), timeout=None)
    for dtype in ("float16", "bfloat16"):
        failed = [r for r in report.results if r.dtype == dtype and r.verdict == FAIL]
        assert failed and all(r.first_failing_stage == "output" for r in failed), dtype
        assert "fails the worst-case contract too" in failed[0].stage("output").message
    # one declaration for both dtypes (alternatives): the same verdicts, and it occurred (no warning)
    cases = sorted({r.case for r in report.results if r.dtype == "float16" and r.verdict == FAIL})[:3]
    one = mhaspec.check(Declared(native, [Deviation("sums accumulated in the dtype (test)", dtype="float16|bfloat16",
                                                    within="worst-case")]), cases=cases, timeout=None)
    two = mhaspec.check(Declared(native, declared), cases=cases, timeout=None)
    assert [(r.case, r.dtype, r.verdict) for r in one.results] == [(r.case, r.dtype, r.verdict) for r in two.results]
    assert one.ok and not one.warnings and {r.verdict for r in one.results if r.dtype == "float16"} == {KNOWN_DEVIATION}


def test_a_bounded_and_a_row_scoped_deviation_compose_and_still_catch_a_bug():
    # float64 with a float32 scale AND uniform weights on rows that see no key (Keras, jax-dpa,
    # flax-nnx-fast): each declaration alone fails those cases; together they excuse them
    declared = [Deviation(SCALE_F32, dtype="float64", within="float32"),
                *(Deviation("uniform weights on rows that see no key (test)", stage=s, rows="fully_masked")
                  for s in ("attn_weights", "head_outputs", "concat", "output"))]
    both = Variant(name="scale_f32+uniform", scale_float32=True, uniform_masked_rows=True)
    case = "causal_bottom_right_t_gt_s"
    report = mhaspec.check(Declared(both, declared), cases=[case], timeout=None)
    assert report.ok, report.table()
    assert report.result(case, "float64").verdict == KNOWN_DEVIATION
    assert "left to its row-scoped declaration" in report.result(case, "float64").stage("output").message
    for alone in (declared[:1], declared[1:]):
        assert not mhaspec.check(Declared(both, alone), cases=[case], dtypes=["float64"], timeout=None).ok
    buggy = replace(both, name="scale_f32+uniform+off_by_one", causal_off_by_one=True)
    report = mhaspec.check(Declared(buggy, declared), cases=[case], timeout=None)
    assert {r.dtype for r in report.results if r.verdict == FAIL} == set(DTYPES)
    assert report.result(case, "float64").first_failing_stage == "attn_weights"


@pytest.mark.parametrize("bug", sorted(BACKWARD_BUGS))
def test_a_backward_bug_beyond_a_bounded_deviation_fails_in_every_dtype(bug: str):
    # the bound holds in the backward stages too: a float32 scale declared for every float64
    # stage (forward and backward, as Keras does) hides none of the backward bugs
    variant, stage = BACKWARD_BUGS[bug]
    alone = rejected(report_of(variant, backward=True))
    assert {d for _, d in alone} == set(DTYPES)
    deviating = replace(variant, name=variant.name + "+scale_f32", scale_float32=True)
    bounded = mhaspec.check(DeclaredBackward(deviating, [Deviation(SCALE_F32, dtype="float64", within="float32")]),
                            timeout=None, backward=True)
    assert rejected(bounded) == alone
    float64 = [r for r in bounded.results if r.dtype == "float64" and r.verdict == FAIL]
    assert float64 and all(r.first_failing_stage == stage for r in float64), {r.first_failing_stage for r in float64}


def test_a_float32_scale_bounded_deviation_passes_forward_and_backward():
    honest = replace(BACKWARD_CORRECT["plain"][0], name="plain+scale_f32", scale_float32=True)
    report = mhaspec.check(DeclaredBackward(honest, [Deviation(SCALE_F32, dtype="float64", within="float32")]),
                           timeout=None, backward=True)
    assert report.ok, report.table()
    assert {r.dtype for r in report.results if r.verdict == KNOWN_DEVIATION} == {"float64"}
