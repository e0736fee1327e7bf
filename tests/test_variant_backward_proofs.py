"""Two-sided proof of the attention variants' backward tolerances, per dtype (issue 31; docs/backward.md).

On the variant cases of the catalog in every dtype, the backward judged (tests/backward_variant_zoo.py):
(1) every correct implementation (CORRECT: plain, FlashAttention-style with sinks and a window, softcap′
from the capped score, RoPE turned back by the conjugate, d_bias summed in float32, native accumulation
under the worst-case contract) passes with a margin, every stage exposed and as ``loss.backward()``
shows it (output and the leaves' gradients; a stage may be uninformative, never failing); (2) every bug
of the kill list (KILL_LIST) fails on every case and dtype where it changes the float64 backward — every
stage exposed: first at the stage it changes first, under both contracts; the leaf view: at some leaf
gradient, under the standard contract (:data:`PROVED`; the one blind spot: :data:`BLIND`).  A bug that
no catalog case shows is proved on tests/variant_cases.py's "everything" (:data:`NOT_IN_THE_CATALOG`).
The figures: benchmarks/variant_backward_figures.py (benchmarks/results/2026-12-06-variant-backward-proofs.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.conformance import ERROR, FAIL, PASS
from mhaspec.conformance.compare import UNINFORMATIVE
from mhaspec.spec import BACKWARD_STAGES, DTYPES
from mhaspec.spec.stages import BACKWARD_VARIANT_STAGES, STAGE, compared_entries

from .backward_variant_zoo import CORRECT, KILL_LIST, correct_twin, leaf_only
from .variant_cases import variant_golden, variant_report, written_golden
from .zoo import CHANGED

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

VIEWS = ("every stage", "leaf gradients")
_LEAF = {name: leaf_only(v) for name, (v, _) in {**CORRECT, **KILL_LIST}.items()}


def adapter_of(name: str, view: str):
    """The zoo's implementation ``name`` (CORRECT or KILL_LIST), every stage exposed or as ``loss.backward()``
    shows it."""
    return {**CORRECT, **KILL_LIST}[name][0] if view == "every stage" else _LEAF[name]


def first_changed_backward_stage(adapter, golden) -> str | None:
    """The first backward stage (judging order) on which ``adapter``'s float64 backward of the golden case
    differs from its correct twin's (:func:`correct_twin`: the same arithmetic, the bug off) by more than
    :data:`tests.zoo.CHANGED` of the golden stage's magnitude (the entries a stage does not compare left
    out; an exception: the first stage), or None where the bug changes nothing.  The twin, not the golden:
    d_b_k is 0 up to rounding, which any float64 order of sums changes."""
    case = golden.case("float64")
    try:
        returned = adapter.backward(case)
    except Exception:
        return BACKWARD_STAGES[0]
    right = correct_twin(adapter).backward(case)
    for stage in BACKWARD_STAGES:
        if stage not in returned or stage not in golden.stages:
            continue
        got, want = np.asarray(returned[stage], dtype=np.float64), np.asarray(right[stage], dtype=np.float64)
        if got.shape != want.shape:
            return stage
        compared = compared_entries(stage, golden.visible)
        if compared is not None:
            got, want = np.where(compared, got, 0.0), np.where(compared, want, 0.0)
        with np.errstate(invalid="ignore"):
            diff = float(np.max(np.abs(got - want), initial=0.0))
        magnitude = float(np.max(np.abs(np.asarray(golden.stages[stage], dtype=np.float64)), initial=0.0))
        if not np.isfinite(diff) or diff > CHANGED * (magnitude + 1e-300):
            return stage
    return None


_EXPECTED: dict[int, dict[str, str]] = {}


def expected_backward_stages(adapter) -> dict[str, str]:
    """case id -> the backward stage where ``adapter`` must first be caught: the first it changes in float64
    (cases it does not change are left out)."""
    if id(adapter) not in _EXPECTED:
        golden, ids = variant_golden()
        found = {cid: first_changed_backward_stage(adapter, golden.load(cid)) for cid in ids}
        _EXPECTED[id(adapter)] = {cid: stage for cid, stage in found.items() if stage is not None}
    return _EXPECTED[id(adapter)]


def worst_ratio(report) -> float:
    """The largest error/tolerance over every judged stage of the report (1 / the smallest margin)."""
    return max((st.worst_ratio or 0.0) for r in report.results for st in r.stages if st.verdict in (PASS, FAIL))


def caught_at(report, expected: dict[str, str], anywhere: bool = False) -> tuple[list, list]:
    """(missed: (case, dtype, verdict) not failed; wrong: (case, dtype, first failing, expected) failed at
    another stage, unless ``anywhere``) of ``report`` against ``expected`` (case id -> stage)."""
    by = {(r.case, r.dtype): r for r in report.results}
    missed = [(c, d, by[c, d].verdict) for c in expected for d in DTYPES if by[c, d].verdict not in (FAIL, ERROR)]
    wrong = [(c, d, by[c, d].first_failing_stage, s) for c, s in expected.items() for d in DTYPES
             if not anywhere and by[c, d].verdict == FAIL and by[c, d].first_failing_stage != s]
    return missed, wrong


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_backward_implementations_pass_every_variant_case_and_dtype(name, view):
    precision = CORRECT[name][1]
    report = variant_report(adapter_of(name, view), precision, backward=True)
    assert len(report.results) == len(DTYPES) * len(variant_golden()[1])
    # uninformative: a stage whose bound is wider than the golden (16-bit leaf gradients, worst-case): not a fail
    assert report.ok and all(r.verdict in (PASS, UNINFORMATIVE) for r in report.results), report.table()
    worst = worst_ratio(report)
    # a worst ratio above 1/2 would mean a correct implementation comes close to failing
    assert worst <= 0.5, f"{name} ({view}, {precision}): worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


def test_the_variant_gradients_are_judged():
    """d_sink_logits, d_bias, d_q_rot and d_k_rot are returned and judged (not skipped) wherever the case
    has them, and the leaf view's d_sink_logits and d_bias too."""
    for view, stages in (("every stage", BACKWARD_VARIANT_STAGES), ("leaf gradients", ("d_sink_logits", "d_bias"))):
        report = variant_report(adapter_of("plain", view), backward=True)
        judged = {st.stage for r in report.results for st in r.stages if st.verdict == PASS}
        assert set(stages) <= judged, (view, judged)


#: Bugs no variant case of the catalog shows: softcap′ from the post-bias scores needs softcap and a bias or
#: ALiBi in one case (none in the catalog); proved on tests/variant_cases.py's "everything" instead
#: (test_softcap_prime_from_the_post_bias_scores_is_caught_where_a_bias_follows_the_softcap).
NOT_IN_THE_CATALOG = ("softcap_prime_from_post_bias_scores",)


#: (bug, view, precision) -> the (case, dtype) where it is known to pass because the stage it changes is
#: uninformative there (its bound at least the golden's magnitude): the worst-case contract's bound of
#: d_sink_logits in bfloat16 on gpt_oss_sinks_window (B·T = 30 terms per head) cannot see the sign.
BLIND = {("d_sink_logits_sign_flipped", "every stage", "worst-case"): {("gpt_oss_sinks_window", "bfloat16")}}

#: The views and contracts the kill list is proved under: every stage in both contracts; the leaf view in the
#: standard one (under the worst-case contract 16-bit leaf gradients are too loose to resolve most of the kill
#: list: benchmarks/variant_backward_figures.py prints how much).
PROVED = [("every stage", "standard"), ("every stage", "worst-case"), ("leaf gradients", "standard")]


@pytest.mark.parametrize("view, precision", PROVED)
@pytest.mark.parametrize("name", sorted(set(KILL_LIST) - set(NOT_IN_THE_CATALOG)))
def test_a_kill_list_bug_is_caught_at_its_stage_in_every_dtype(name, view, precision):
    """Every stage exposed: failed at the first stage the bug changes.  As loss.backward() shows it: failed
    (at whichever leaf gradient resolves it: a bug may change a leaf gradient by less than its tolerance
    and the next one by more — benchmarks/variant_backward_figures.py counts both).  Except where
    :data:`BLIND` says, with the stage uninformative there."""
    adapter = adapter_of(name, view)
    expected = expected_backward_stages(adapter)
    assert expected, f"{name} changes no variant case's backward in float64"
    if view == "every stage":
        assert set(expected.values()) <= set(KILL_LIST[name][1]), (name, expected)
    report = variant_report(adapter, precision, backward=True)
    missed, wrong = caught_at(report, expected, anywhere=view != "every stage")
    blind = BLIND.get((name, view, precision), set())
    assert {(c, d) for c, d, _ in missed} == blind, \
        f"{name} ({view}, {precision}) not caught on {len(missed)} case×dtype: {missed[:8]} (known: {blind})"
    for case, dtype in blind:
        stage = report.result(case, dtype).stage(expected[case])
        assert stage.verdict == UNINFORMATIVE, (case, dtype, stage.verdict)
    assert not wrong, f"{name} ({view}, {precision}): first failing stage (case, dtype, got, expected): {wrong[:8]}"
    unchanged = [(r.case, r.dtype, r.first_failing_stage) for r in report.results
                 if r.case not in expected and r.verdict in (FAIL, ERROR)]
    assert not unchanged, f"{name} fails where it does not change the float64 result: {unchanged[:3]}"


def test_the_bugs_left_out_change_no_catalog_case():
    for name in NOT_IN_THE_CATALOG:
        assert not expected_backward_stages(adapter_of(name, "every stage")), name


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    """(golden set, case ids) of tests/variant_cases.py's "everything" (RoPE, softcap, ALiBi, a bias, sinks and
    a window in one case), its fixture written by the exact reference (forward and backward)."""
    return written_golden(["everything"], tmp_path_factory.mktemp("everything"))


@pytest.mark.parametrize("view", VIEWS)
def test_softcap_prime_from_the_post_bias_scores_is_caught_where_a_bias_follows_the_softcap(everything, view):
    import mhaspec

    from .variant_cases import judged_variants

    golden, ids = everything
    bug, twin = adapter_of("softcap_prime_from_post_bias_scores", view), adapter_of("plain", view)
    stage = first_changed_backward_stage(bug, golden.load(ids[0]))
    assert stage in (KILL_LIST["softcap_prime_from_post_bias_scores"][1] if view == "every stage" else
                     (STAGE.d_query, STAGE.d_key, STAGE.d_value)), stage
    with judged_variants():
        reports = [mhaspec.check(a, cases=ids, golden=golden, timeout=None, isolate=False, backward=True)
                   for a in (bug, twin)]
    assert reports[1].ok and all(r.verdict == PASS for r in reports[1].results), reports[1].table()
    missed, wrong = caught_at(reports[0], {ids[0]: stage}, anywhere=view != "every stage")
    assert not missed and not wrong, (missed, wrong)


def test_the_figures_per_dtype(capsys):
    """Per dtype: the share of the kill list caught where it changes the float64 result (every stage exposed:
    at the first stage it changes; the leaf view: at any leaf gradient; standard contract), and the correct implementations' smallest margin (both views, each
    under its contract).  benchmarks/variant_backward_figures.py prints them per bug and implementation."""
    caught = {d: [0, 0] for d in DTYPES}
    for name in sorted(set(KILL_LIST) - set(NOT_IN_THE_CATALOG)):
        for view in VIEWS:
            adapter = adapter_of(name, view)
            expected = expected_backward_stages(adapter)
            missed, wrong = caught_at(variant_report(adapter, backward=True), expected, anywhere=view != "every stage")
            for d in DTYPES:
                caught[d][1] += len(expected)
                caught[d][0] += len(expected) - sum(m[1] == d for m in missed + wrong)
    margin = {}
    for d in DTYPES:
        margin[d] = 1 / max((st.worst_ratio or 0.0) for name, (_, precision) in CORRECT.items() for view in VIEWS
                            for r in variant_report(adapter_of(name, view), precision, backward=True).results
                            if r.dtype == d for st in r.stages if st.verdict in (PASS, FAIL))
    with capsys.disabled():
        print("\nvariants' backward kill list caught (every stage: at its first changed stage; leaf view: at a leaf "
              "gradient; standard contract): "
              + ", ".join(f"{d} {a}/{b} = {a / b:.1%}" for d, (a, b) in caught.items())
              + "\ncorrect backward implementations' smallest margin: "
              + ", ".join(f"{d} {m:.3g}x" for d, m in margin.items()))
    assert all(a == b > 0 for a, b in caught.values()), caught
    assert all(m >= 2 for m in margin.values()), margin
