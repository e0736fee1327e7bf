"""A declared deviation bounded by ``within`` excuses the deviation, never a bug at the same stage.

The adapter under test takes the scale in float32 whatever the dtype (what Keras and the ONNX
exporters do in float64; declared there ``within="float32"``), or accumulates in the dtype itself
(declared ``within="worst-case"``), or leaves a tiny absolute error where the spec has an exact 0
(PaddlePaddle's CPU softmax at masked weights; declared with an absolute bound, ``within=1e-27``).
On top of it, realistic bugs of tests/variants.py must be rejected on exactly the case × dtype where
they are rejected without any deviation — in every dtype — while an unbounded declaration hides them
in the dtype it covers.
benchmarks/deviation_figures.py prints the same over every bug.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters import Deviation, parse_deviations
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.conformance import ERROR, FAIL, KNOWN_DEVIATION, PASS
from mhaspec.conformance.compare import round_to_bfloat16
from mhaspec.errors import AdapterError
from mhaspec.spec import DTYPES

from .backward_variants import BUGS as BACKWARD_BUGS
from .backward_variants import CORRECT as BACKWARD_CORRECT
from .reports import judged_cases, report_of
from .variants import BUGS, NATIVE, OUTPUT_ONLY_BUGS, Variant
from .zoo import visible_cases

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

SCALE_F32 = "the scale is taken in float32 (test)"


class Declared:
    """``variant`` with ``known_deviations``."""

    def __init__(self, variant: Variant, deviations: list[Deviation]) -> None:
        self.variant, self.name, self.known_deviations = variant, variant.name, deviations
        self.variants = getattr(variant, "variants", frozenset())  # the attention variants it computes

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
    assert all(r.verdict == PASS for r in report.results if r.dtype != "float64" and r.verdict != "unsupported")
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


class TinyAtMaskedWeights(NumpyMHA):
    """Correct, except that every masked attention weight (exactly 0 in the spec) is ``error``, as
    PaddlePaddle's CPU softmax leaves 1.6e-28 there."""

    name = "tiny-at-masked"

    def __init__(self, error: float, deviations: list[Deviation] = ()) -> None:
        super().__init__()
        self.error, self.known_deviations = error, list(deviations)

    def run(self, case):
        out = super().run(case)
        weights = np.asarray(out["attn_weights"])
        wrong = weights.astype(np.float64)
        wrong[~np.broadcast_to(case.visible, wrong.shape)] = self.error
        out["attn_weights"] = wrong.astype(weights.dtype)  # rounded to the dtype: a value of it
        return out


#: per dtype: (the tiny error, the absolute bound declared, an error beyond it).  float16 cannot hold
#: 1.6e-28 (its smallest value is 2^-24 = 6e-8): the same test one scale up.
ABSOLUTE = {"float64": (1.6e-28, 1e-27, 1e-20), "float32": (1.6e-28, 1e-27, 1e-20),
            "bfloat16": (1.6e-28, 1e-27, 1e-20), "float16": (2.0**-24, 1e-7, 2.0**-20)}
MASKED = ["causal_square", "key_padding", "custom_mask", "causal_bottom_right_t_gt_s"]  # have masked weights
TINY = "softmax leaves a tiny value at masked weights (test)"


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_absolute_bound_excuses_a_tiny_error_at_masked_weights_and_nothing_more(dtype: str):
    tiny, bound, beyond = ABSOLUTE[dtype]
    declared = [Deviation(TINY, stage="attn_weights", within=bound)]
    cases = [*MASKED, "gqa"]  # gqa: nothing masked, nothing to excuse
    alone = mhaspec.check(TinyAtMaskedWeights(tiny), dtypes=[dtype], cases=cases, timeout=None)
    assert {(r.case, r.first_failing_stage) for r in alone.results if r.verdict == FAIL} == {
        (c, "attn_weights") for c in MASKED}, alone.table()
    report = mhaspec.check(TinyAtMaskedWeights(tiny, declared), dtypes=[dtype], cases=cases, timeout=None)
    assert report.ok and report.exit_code == 0 and not report.warnings, report.table()
    assert report.result("gqa", dtype).verdict == PASS
    rounded = float(round_to_bfloat16(np.array(tiny)) if dtype == "bfloat16" else np.asarray(tiny).astype(dtype))
    for case in MASKED:
        st = report.result(case, dtype).stage("attn_weights")
        assert st.verdict == KNOWN_DEVIATION and st.reason == TINY and st.within == bound
        assert rounded / bound * 0.99 <= st.within_ratio <= 1, st  # how close to the bound it came
        assert st.worst_ratio == np.inf  # against the normal tolerance: 0 where masked
        assert f"(its tolerances or |error| ≤ {bound:g}): worst ratio" in st.message
    stage = next(st for st in report.to_json()["results"][0]["stages"] if st["stage"] == "attn_weights")
    assert stage["stage"] == "attn_weights" and stage["within"] == bound and stage["within_ratio"] <= 1
    assert f"against its declared bound (within: {bound:g})" in "\n".join(report.footer())
    # an error beyond the bound is a failure, declaration or not
    worse = mhaspec.check(TinyAtMaskedWeights(beyond, declared), dtypes=[dtype], cases=cases, timeout=None)
    assert {(r.case, r.first_failing_stage) for r in worse.results if r.verdict == FAIL} == {
        (c, "attn_weights") for c in MASKED}, worse.table()
    message = worse.result(MASKED[0], dtype).stage("attn_weights").message
    assert (f"beyond its declared deviation (*/*/attn_weights (within: {bound:g})): fails its tolerances or "
            f"|error| ≤ {bound:g} too") in message, message


@pytest.mark.parametrize("bug", ["output_bias_dropped", "causal_off_by_one", "softmax_over_queries+output_only"])
def test_a_bug_beyond_an_absolute_bound_fails_in_every_dtype(bug: str):
    # 1e-27 on every stage excuses only errors no bug leaves: the bugs are rejected where they are alone
    variant, stage = {**BUGS, **OUTPUT_ONLY_BUGS}[bug]
    alone = rejected(report_of(variant))
    assert {d for _, d in alone} == set(DTYPES)
    bounded = mhaspec.check(Declared(variant, [Deviation(TINY, within=1e-27)]), cases=judged_cases(variant),
                            timeout=None, isolate=False)
    assert rejected(bounded) == alone
    assert [r.first_failing_stage for r in bounded.results] == [r.first_failing_stage
                                                               for r in report_of(variant).results]
    assert {r.first_failing_stage for r in bounded.results if r.dtype == "float64"} == {None, stage}


@pytest.mark.parametrize("within, said", [(-1e-27, "-1e-27"), (0.0, "0.0"), (float("nan"), "nan"),
                                          (float("inf"), "inf"), (True, "True"), ("1e-27", "'1e-27'")])
def test_an_absolute_bound_must_be_a_positive_finite_number(within, said):
    with pytest.raises(AdapterError) as raised:
        parse_deviations([Deviation(TINY, stage="attn_weights", within=within)], "adapter mine: known_deviations")
    text = str(raised.value)
    assert text.startswith("adapter mine: known_deviations: deviation */*/attn_weights (within: ") and \
        f"or a positive finite number (an absolute bound on |error|, e.g. 1e-27), not {said}" in text, text
    (dev,) = parse_deviations([{"reason": TINY, "within": np.float32(1e-27)}])
    assert type(dev.within) is float and dev.within == float(np.float32(1e-27))
    assert parse_deviations([Deviation(TINY, within=1)])[0].within == 1.0


class TinyAtMaskedScoresGradient(DeclaredBackward):
    """A correct backward, except that d_scores (exactly 0 where masked in the spec) is ``error`` there."""

    def __init__(self, error: float, deviations: list[Deviation] = ()) -> None:
        super().__init__(BACKWARD_CORRECT["plain"][0], list(deviations))
        self.error = error

    def backward(self, case):
        out = dict(super().backward(case))
        grad = np.asarray(out["d_scores"])
        wrong = grad.astype(np.float64)
        wrong[~np.broadcast_to(case.visible, wrong.shape)] = self.error
        out["d_scores"] = wrong.astype(grad.dtype)
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_absolute_bound_in_the_backward_excuses_a_tiny_error_and_nothing_more(dtype: str):
    tiny, bound, beyond = ABSOLUTE[dtype]
    # the local checks of d_q_proj and d_k_proj recompute them from this d_scores: declared with it
    declared = [Deviation(TINY, stage="d_scores|d_q_proj|d_k_proj", within=bound)]

    def run(error, deviations=()):
        return mhaspec.check(TinyAtMaskedScoresGradient(error, deviations), dtypes=[dtype], cases=MASKED,
                             timeout=None, backward=True, isolate=False)

    assert {(r.first_failing_stage, r.verdict) for r in run(tiny).results} == {("d_scores", FAIL)}
    report = run(tiny, declared)
    assert report.ok and not report.warnings, report.table()
    for r in report.results:
        st = r.stage("d_scores")
        assert st.verdict == KNOWN_DEVIATION and st.within == bound and st.within_ratio <= 1, (r.case, st)
    assert {(r.first_failing_stage, r.verdict) for r in run(beyond, declared).results} == {("d_scores", FAIL)}


@pytest.mark.parametrize("bug", ["mask_ignored_in_backward", "dq_without_scale", "transposed_dw"])
def test_a_backward_bug_beyond_an_absolute_bound_fails_in_every_dtype(bug: str):
    variant, stage = BACKWARD_BUGS[bug]
    alone = rejected(report_of(variant, backward=True))
    assert {d for _, d in alone} == set(DTYPES)
    bounded = mhaspec.check(DeclaredBackward(variant, [Deviation(TINY, within=1e-27)]), timeout=None,
                            backward=True, isolate=False)
    assert rejected(bounded) == alone
    assert {r.first_failing_stage for r in bounded.results if r.verdict == FAIL} == {stage}


def test_a_row_scoped_declaration_selects_the_rows_of_lse_too():
    """lse (B, H, T) has no key axis: the rows that see no key are its own elements (a declaration on lse with
    rows="fully_masked", as jax-dpa's, once raised a broadcasting error)."""
    from mhaspec.conformance.deviations import outside_blind_rows
    from mhaspec.fixtures import GoldenSet

    golden = GoldenSet().load("window_bottom_right_t_gt_s")
    blind = ~golden.visible.any(axis=-1)  # (B, H, T)
    assert blind.any() and not blind.all()
    assert np.array_equal(outside_blind_rows(golden, "lse"), ~blind)
    weights = outside_blind_rows(golden, "attn_weights")
    assert weights.shape == golden.stages["attn_weights"].shape and np.array_equal(weights[..., 0], ~blind)
