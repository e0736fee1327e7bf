"""The variants' tolerance rules, two-sided per dtype (docs/tolerances.md "The variants"): a plain
implementation of each variant in the dtype under test (the second opinion's, float32 sums and softmax for
16-bit dtypes: :func:`mhaspec.conformance.second_opinion.plain_forward`) passes every stage, with margin,
in float64, float32, float16 and bfloat16 under both precision contracts; and the bugs of issue 31's kill
list fail at the right first stage.  A bug is a correct implementation of another function: the same plain
implementation on a case whose config differs where the bug lies (softcap dropped, ALiBi slopes negated, no
sink, RoPE style swapped, window one wider), or a stage transformed (the LSE in base 2).

Golden cases come from the exact reference (:func:`mhaspec.reference.mha.forward`) until the fast
reference and the catalog judge the variants (wt-golden); a variant case is refused by ``Catalog`` until
``NOT_JUDGED_YET`` is lifted, so these tests build their GoldenCases directly.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mhaspec.conformance.compare import FAIL, PASS
from mhaspec.conformance.runner import Session
from mhaspec.conformance.second_opinion import plain_forward
from mhaspec.fixtures import GoldenCase
from mhaspec.reference.mha import forward
from mhaspec.spec import REGISTRY, CaseSpec, MHAConfig
from mhaspec.spec.masks import visibility
from mhaspec.spec.variants import alibi_slope_values

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

DTYPES = ("float64", "float32", "float16", "bfloat16")


def golden_of(spec: CaseSpec) -> GoldenCase:
    """The exact reference's golden case of ``spec`` (every stage, ``lse`` and, with rope, ``q_rot``/``k_rot``)."""
    inputs, weights = spec.make_inputs(), spec.make_weights()
    visible = visibility(spec.config, inputs.get("mask"), spec.batch, spec.tgt_len, spec.src_len)
    return GoldenCase(spec=spec, inputs=inputs, weights=weights, stages=forward(spec.config, inputs, weights),
                      visible=visible, path=Path(f"<{spec.id}>"))


def _spec(case_id: str, T: int = 9, S: int = 11, seed: int = 5, bias: Any = None, **config: Any) -> CaseSpec:
    return CaseSpec(id=case_id, config=MHAConfig(**{"d_model": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 6,
                                                     **config}),
                    batch=2, tgt_len=T, src_len=S, seed=seed, **({} if bias is None else {"bias": bias}))


#: A few small cases per variant (and the combinations real models ship).
CASES = {
    "window": _spec("window", window_left=3, window_right=1),
    "window_causal_br": _spec("window_causal_br", window_left=2, causal=True, causal_alignment="bottom_right"),
    "window_br_long": _spec("window_br_long", window_left=3, window_right=2, causal_alignment="bottom_right", T=6,
                            S=13),
    "softcap": _spec("softcap", softcap=2.0),
    "softcap_large": _spec("softcap_large", softcap=8.0, scale=4.0, seed=9),
    "alibi": _spec("alibi", alibi_slopes="standard", causal=True, T=11),
    "alibi_cross": _spec("alibi_cross", alibi_slopes="standard", T=7, S=23, seed=7),
    "bias": _spec("bias", bias={"per_head": True, "per_batch": True}),
    "sinks": _spec("sinks", sinks=True),
    "sinks_window": _spec("sinks_window", sinks=True, window_left=2, causal=True, seed=8),
    "rope": _spec("rope", rope={"theta": 10000.0}),
    "rope_interleaved_offset": _spec("rope_interleaved_offset", rope={"style": "interleaved", "query_offset": 300,
                                                                      "key_offset": 290}, causal=True),
    "rope_partial": _spec("rope_partial", rope={"rotary_dim": 4, "theta": 500000.0}),
    "gemma2": _spec("gemma2", softcap=5.0, window_left=3, causal=True),
    "gpt_oss": _spec("gpt_oss", sinks=True, window_left=4, causal=True, rope={"theta": 150000.0}),
    "rope_far": _spec("rope_far", T=16, S=40, rope={"query_offset": 4000, "key_offset": 3976}, causal=True,
                      causal_alignment="bottom_right"),  # float32 angles at position 4000: about 1e-3 off
    "everything": _spec("everything", T=12, S=64, rope={"theta": 500000.0, "rotary_dim": 4, "query_offset": 52},
                        softcap=10.0, alibi_slopes="standard", sinks=True, window_left=20, causal=True,
                        causal_alignment="bottom_right", bias={"per_head": False}),
}


def _with(spec: CaseSpec, **config: Any) -> CaseSpec:
    return spec.model_copy(update={"config": spec.config.model_copy(update=config)})


def _flipped_style(spec: CaseSpec) -> CaseSpec:
    rope = spec.config.rope
    return _with(spec, rope=rope.model_copy(update={"style": "interleaved" if rope.style == "half" else "half"}))


#: Issue 31's kill list (the forward part this suite can state as another function): name -> (applies to the
#: case, the wrong case it computes or a stage transform, the first stage where it shows, or a function of the
#: case that names it: :func:`expected_stage`).
BUGS = {
    "softcap missing": (lambda s: s.config.softcap is not None, lambda s: _with(s, softcap=None), "scores"),
    "ALiBi wrong sign": (lambda s: s.config.alibi_slopes is not None,
                         lambda s: _with(s, alibi_slopes=[-float(x) for x in alibi_slope_values(s.config)]), "scores"),
    "sink missing from the denominator": (lambda s: s.config.sinks, lambda s: _with(s, sinks=False), "lse"),
    "RoPE style swapped": (lambda s: s.config.rope is not None, _flipped_style, "q_rot"),
    "window off by one": (lambda s: s.config.window_left is not None,
                          lambda s: _with(s, window_left=s.config.window_left + 1), "lse"),
    "window right off by one": (lambda s: s.config.window_right is not None,
                                lambda s: _with(s, window_right=s.config.window_right + 1), "lse"),
    "window aligned top-left instead of bottom-right": (
        lambda s: s.config.window_left is not None and s.config.causal_alignment == "bottom_right" and s.tgt_len != s.src_len,
        lambda s: _with(s, causal_alignment="top_left"),
        lambda s: "scores" if s.config.alibi_slopes is not None else "lse"),  # the ALiBi anchor moves too
    "RoPE positions ignore the offset": (lambda s: s.config.rope is not None and s.config.rope.query_offset > 0,
                                         lambda s: _with(s, rope=s.config.rope.model_copy(
                                             update={"query_offset": 0, "key_offset": 0})), "q_rot"),
    "rotary_dim ignored": (lambda s: s.config.rope is not None and s.config.rope.rotary_dim < s.config.D_k,
                           lambda s: _with(s, rope=s.config.rope.model_copy(update={"rotary_dim": s.config.D_k})),
                           "q_rot"),
    "LSE in base 2": (lambda s: True, "lse2", "lse"),
}


def expected_stage(bug: str, spec: CaseSpec) -> str:
    """The first stage where ``bug`` shows on ``spec``."""
    where = BUGS[bug][2]
    return where if isinstance(where, str) else where(spec)


def implementation(golden: GoldenCase, dtype: str, bug: str | None = None, order: str = "scale-after") -> dict:
    """The stages of a plain implementation of ``golden``'s case in ``dtype`` (with ``bug``), as float64."""
    spec, how = golden.spec, None if bug is None else BUGS[bug][1]
    if callable(how):  # another function: the plain implementation of the wrong case, on the same inputs
        wrong = how(spec)
        weights = dict(golden.weights)
        if not wrong.config.sinks:
            weights.pop("sink_logits", None)
        golden = GoldenCase(spec=wrong, inputs=golden.inputs, weights=weights, stages=golden.stages, path=golden.path,
                            visible=visibility(wrong.config, golden.inputs.get("mask"), spec.batch, spec.tgt_len,
                                               spec.src_len))
    stages = {k: np.asarray(v, dtype=np.float64) for k, v in dict(next(
        st for o, st in plain_forward(golden, dtype, (order,)) if o == order)).items()}
    if how == "lse2":
        stages["lse"] = stages["lse"] / math.log(2.0)
    return stages


class _Adapter:  # the Session's adapter slot (never called: the tests hand it each result)
    name, dtypes, variants = "plain", DTYPES, ("window", "softcap", "alibi", "bias", "sinks", "rope")

    def run(self, case: Any) -> dict:  # pragma: no cover
        raise AssertionError("not called")


def judge(golden: GoldenCase, dtype: str, returned: dict, precision: str = "standard") -> list:
    with Session(_Adapter(), precision=precision, isolate=False) as session:
        stages = session.judge_stages(golden, dtype, returned)
    from mhaspec.conformance import second_opinion
    for st in stages:
        second_opinion.fold(st)
    return stages


def first_failure(stages: list) -> str | None:
    return next((st.stage for st in stages if st.verdict == FAIL), None)


def worst_ratio(stages: list) -> float:
    return max(max(st.worst_ratio or 0.0, st.local_worst_ratio or 0.0) for st in stages)


@pytest.mark.parametrize("precision", ["standard", "worst-case"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_correct_plain_implementation_passes_with_margin(name: str, dtype: str, precision: str) -> None:
    golden = golden_of(CASES[name])
    for order in ("scale-after", "log-sum-exp"):
        stages = judge(golden, dtype, implementation(golden, dtype, order=order), precision)
        bad = [(st.stage, st.message) for st in stages if st.verdict != PASS]
        assert not bad, (name, dtype, order, bad)
        assert worst_ratio(stages) <= 0.5, (name, dtype, order, worst_ratio(stages))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_fails_at_its_stage(bug: str, dtype: str) -> None:
    applies = BUGS[bug][0]
    judged = 0
    for name, spec in CASES.items():
        if not applies(spec):
            continue
        golden = golden_of(spec)
        wrong = implementation(golden, "float64", bug)
        if np.allclose(wrong["output"], golden.stages["output"], rtol=0, atol=0) and bug != "LSE in base 2":
            continue  # the bug does not change this case's float64 result
        judged += 1
        stages = judge(golden, dtype, implementation(golden, dtype, bug))
        assert first_failure(stages) == expected_stage(bug, spec), (bug, name, dtype, [(s.stage, s.verdict, s.message) for s in stages])
    assert judged


def test_a_variant_case_takes_the_models_general_rule_and_a_spec11_case_keeps_its_figures() -> None:
    from mhaspec.conformance.model import variants as variant_rules
    from mhaspec.conformance.model.vocabulary import rounding
    from mhaspec.conformance.tolerance import golden_bounds
    from mhaspec.spec.tolerance import DEFAULT_TOLERANCES

    golden = golden_of(CASES["gpt_oss"])
    assert variant_rules.variant_case(golden)
    r = rounding("bfloat16", "standard", DEFAULT_TOLERANCES)
    general = variant_rules.golden_errors(golden, r)
    bounds = golden_bounds(golden, "bfloat16")
    assert list(bounds) == ["q_proj", "k_proj", "v_proj", "q_rot", "k_rot", "scores", "lse", "attn_weights",
                            "head_outputs", "concat", "output"]
    np.testing.assert_array_equal(bounds["lse"].sigma, general["lse"].bound(r.floor).sigma)
    # a spec-1.1 case (a window alone changes only visibility): the engines' bounds, unchanged by lse
    plain = golden_of(_spec("plain", causal=True))
    assert not variant_rules.variant_case(plain) and not variant_rules.variant_case(golden_of(CASES["window"]))
    without = {k: v for k, v in plain.stages.items() if k != "lse"}
    before = golden_bounds(dataclasses.replace(plain, stages=without), "float16")
    after = golden_bounds(plain, "float16")
    assert list(after) == [*before][:4] + ["lse"] + [*before][4:]
    for name, b in before.items():
        np.testing.assert_array_equal(b.sigma, after[name].sigma)
        np.testing.assert_array_equal(b.worst, after[name].worst)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_of_a_row_that_sees_no_key_must_be_minus_inf(dtype: str) -> None:
    spec = _spec("blind", T=13, S=9, causal=True, causal_alignment="bottom_right", sinks=True)
    golden = golden_of(spec)
    blind = ~golden.visible.any(-1)
    assert blind.any() and np.isneginf(golden.stages["lse"][blind]).all()
    got = implementation(golden, dtype)
    assert first_failure(judge(golden, dtype, got)) is None
    for wrong in (np.inf, 0.0):  # FA2's +inf, or a finite value
        bad = dict(got, lse=np.where(blind, wrong, got["lse"]))
        assert first_failure(judge(golden, dtype, bad)) == "lse"


@pytest.mark.parametrize("name", ["gpt_oss", "alibi_cross", "rope_interleaved_offset", "bias"])
def test_a_block_of_query_rows_gets_the_whole_cases_bounds(name: str) -> None:
    """Positions, ALiBi distances and windows by the block's place in the case (``row_offset``)."""
    from mhaspec.conformance.blocks import block_case
    from mhaspec.conformance.tolerance import golden_bounds, local_references

    golden = golden_of(CASES[name])

    def rows_of(stage: str, x: np.ndarray) -> np.ndarray:  # batch entry 1, query rows 3..6 (every key)
        axis = REGISTRY[stage].rows
        index = [slice(1, 2)] + ([] if axis is None else [slice(None)] * (axis - 1) + [slice(3, 7)])
        return np.broadcast_to(x, golden.stages[stage].shape)[tuple(index)]

    blk = block_case(golden, 1, 3, 7)
    whole, block = golden_bounds(golden, "bfloat16"), golden_bounds(blk, "bfloat16")
    for stage, b in block.items():
        for part in ("sigma", "worst"):
            np.testing.assert_allclose(getattr(b, part), rows_of(stage, getattr(whole[stage], part)),
                                       rtol=1e-6, atol=0, err_msg=f"{name} {stage} {part}")
    own = implementation(golden, "bfloat16")
    whole_l = local_references(golden, own, "bfloat16")
    block_l = local_references(blk, {k: rows_of(k, v) for k, v in own.items()}, "bfloat16")
    assert set(block_l) == set(whole_l)
    for stage, (ref, bound) in block_l.items():
        np.testing.assert_allclose(ref, rows_of(stage, whole_l[stage][0]), rtol=1e-12, err_msg=f"{name} local {stage}")
        np.testing.assert_allclose(bound.tolerance(8.0), rows_of(stage, whole_l[stage][1].tolerance(8.0)), rtol=1e-6,
                                   err_msg=f"{name} local {stage} bound")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_hidden_the_local_scores_turn_the_adapters_own_projections(dtype: str) -> None:
    """Without q_rot and k_rot the local scores come from the adapter's q_proj and k_proj, turned in float64."""
    golden = golden_of(CASES["rope_interleaved_offset"])
    hide = ("q_rot", "k_rot")
    got = {k: v for k, v in implementation(golden, dtype).items() if k not in hide}
    stages = judge(golden, dtype, got)
    scores = next(st for st in stages if st.stage == "scores")
    assert first_failure(stages) is None and scores.local_worst_ratio is not None
    assert scores.local_worst_ratio <= 0.5
    bad = {k: v for k, v in implementation(golden, dtype, "RoPE style swapped").items() if k not in hide}
    assert first_failure(judge(golden, dtype, bad)) == "scores"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_worst_case_lse_of_a_spec11_case_is_the_general_rules(dtype: str) -> None:
    from mhaspec.conformance.model import variants as variant_rules
    from mhaspec.conformance.tolerance import worst_case_tolerances

    golden = golden_of(_spec("plain_masked", causal=True, causal_alignment="bottom_right", T=13, S=9))
    np.testing.assert_allclose(worst_case_tolerances(golden, dtype)["lse"],
                               variant_rules.worst_case_tolerances(golden, dtype)["lse"], rtol=1e-9)


def test_backward_asked_a_variant_case_is_judged_forward_and_the_report_says_so() -> None:
    golden = golden_of(CASES["gpt_oss"])

    class WithBackward(_Adapter):
        def run(self, case: Any) -> dict:
            return implementation(golden, "float32")

        def backward(self, case: Any) -> dict:  # pragma: no cover
            raise AssertionError("a variant case has no backward golden: never asked")

    with Session(WithBackward(), isolate=False, backward=True) as session:
        verdict = session._judge(golden, "float32")  # (not a case of the golden folder: judged directly)
        report = session.report([verdict], ["float32"], 0.0)
    assert verdict.verdict == PASS and {s.stage for s in verdict.stages} >= {"q_rot", "lse", "output"}
    said = [w for w in report.warnings if "no backward golden" in w]  # (its words: the runner's, wt-golden's)
    assert len(said) == 1 and said[0].startswith("--backward: 1 case×dtype") and "not judged" in said[0]


@pytest.mark.parametrize("variant", [False, True])
def test_a_reference_error_that_names_only_lse_leaves_the_other_stages_exact(variant: bool) -> None:
    """An exact spec-1.1 fixture gets its lse at load, with that computation's bound as its only reference
    error: every other stage is judged as exact."""
    from mhaspec.conformance.tolerance import judging_bounds, stage_tolerances

    golden = golden_of(CASES["sinks"] if variant else _spec("plain", causal=True))
    bound = np.full(golden.stages["lse"].shape, 1e-3)
    widened = dataclasses.replace(golden, reference_error={"lse": bound})
    for dtype in ("float64", "bfloat16"):
        for precision in ("standard", "worst-case"):
            _, exact = judging_bounds(golden, dtype, precision)
            _, tols = judging_bounds(widened, dtype, precision)
            for stage in exact:  # (lse: LAMBDA·sigma + (worst + R), another order of the same sum)
                np.testing.assert_allclose(tols[stage], exact[stage] + (bound if stage == "lse" else 0.0),
                                           rtol=0 if stage != "lse" else 1e-15, atol=0)
        np.testing.assert_array_equal(stage_tolerances(widened, dtype, reference_error=True)["scores"],
                                      stage_tolerances(golden, dtype)["scores"])
