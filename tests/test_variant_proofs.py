"""Two-sided proof of the attention variants' tolerances, per dtype (issue 31; docs/spec.md §2a).

On the variant cases (the built-in catalog's, else tests/variant_cases.py's computed on the fly) in
every dtype: (1) every correct implementation of tests/variants.py — the spec-1.1 ones (CORRECT),
which compute the variants HF's eager way, and the variant alternatives (VARIANT_CORRECT: an online
softmax with sinks and a window exposing P from the LSE, RoPE by complex multiplication, FlexAttention's
score_mod, softcap by reciprocal) — passes with a margin, every stage exposed and output only;
(2) every bug of the kill list (KILL_LIST) fails on every case and dtype where it changes the float64
result, first at the stage it changes first (tests/variant_cases.py: expected_stages), and at
``output`` where only the output is returned.  The figures: benchmarks/variant_figures.py.
"""

from __future__ import annotations

import pytest

from mhaspec.conformance import ERROR, FAIL, PASS
from mhaspec.spec import DTYPES

from .variant_cases import expected_stages, variant_golden, variant_report
from .variants import CORRECT, KILL_LIST, OUTPUT_ONLY_KILL_LIST, VARIANT_CORRECT, output_only

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

ALL_CORRECT = {**CORRECT, **VARIANT_CORRECT}
_OUTPUT_ONLY = {name: output_only(v) for name, v in ALL_CORRECT.items()}


def worst_ratio(report) -> float:
    """The largest error/tolerance over every judged stage of the report (1 / the smallest margin)."""
    return max((st.worst_ratio or 0.0) for r in report.results for st in r.stages if st.verdict in (PASS, FAIL))


@pytest.mark.parametrize("name", sorted(ALL_CORRECT))
@pytest.mark.parametrize("exposed", ["every stage", "output only"])
def test_correct_implementations_pass_every_variant_case_and_dtype(name, exposed):
    adapter = ALL_CORRECT[name] if exposed == "every stage" else _OUTPUT_ONLY[name]
    report = variant_report(adapter)
    assert len(report.results) == len(DTYPES) * len(variant_golden()[1])
    assert report.ok and all(r.verdict == PASS for r in report.results), report.table()
    worst = worst_ratio(report)
    # a worst ratio above 1/2 would mean a correct implementation comes close to failing
    assert worst <= 0.5, f"{name} ({exposed}): worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


def test_the_variant_stages_are_judged():
    """q_rot, k_rot and lse are returned and judged (not skipped) wherever the case has them."""
    report = variant_report(VARIANT_CORRECT["hf_eager"])
    judged = {st.stage for r in report.results for st in r.stages if st.verdict == PASS}
    assert {"q_rot", "k_rot", "lse"} <= judged, judged


@pytest.mark.parametrize("name", sorted(KILL_LIST) + sorted(OUTPUT_ONLY_KILL_LIST))
def test_a_kill_list_bug_is_caught_at_its_stage_in_every_dtype(name):
    adapter, stages = {**KILL_LIST, **OUTPUT_ONLY_KILL_LIST}[name]
    expected = expected_stages(adapter)
    assert expected, f"{name} changes no variant case in float64"
    assert set(expected.values()) <= set(stages), (name, expected)
    by = {(r.case, r.dtype): r for r in variant_report(adapter).results}
    missed = [(case, dtype, by[case, dtype].verdict) for case in expected for dtype in DTYPES
              if by[case, dtype].verdict not in (FAIL, ERROR)]
    assert not missed, f"{name} not caught on {len(missed)} case×dtype: {missed[:8]}"
    wrong = [(case, dtype, by[case, dtype].first_failing_stage, stage) for case, stage in expected.items()
             for dtype in DTYPES if by[case, dtype].verdict == FAIL and by[case, dtype].first_failing_stage != stage]
    assert not wrong, f"{name}: first failing stage (case, dtype, got, expected) on {len(wrong)}: {wrong[:8]}"
    unchanged = [r for r in by.values() if r.case not in expected and r.verdict != PASS]
    assert not unchanged, f"{name} fails where it does not change the float64 result: {unchanged[:3]}"


def test_the_numpy_adapter_conforms_on_every_variant_case_and_dtype():
    from mhaspec.adapters.numpy_mha import NumpyMHA

    report = variant_report(NumpyMHA())
    assert report.ok and all(r.verdict == PASS for r in report.results), report.table()
    judged = {st.stage for r in report.results for st in r.stages if st.verdict == PASS}
    assert {"q_rot", "k_rot", "lse"} <= judged, judged
    worst = worst_ratio(report)
    assert worst <= 0.5, f"numpy: worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


def test_the_figures_per_dtype(capsys):
    """The issue's "done when": per dtype, the share of the kill list caught at its stage where it changes
    the float64 result (every stage exposed and output only), and the correct implementations' smallest
    margin (tolerance / error at the worst element).  benchmarks/variant_figures.py prints them in full."""
    caught = {d: [0, 0] for d in DTYPES}
    for adapter, _ in {**KILL_LIST, **OUTPUT_ONLY_KILL_LIST}.values():
        expected = expected_stages(adapter)
        by = {(r.case, r.dtype): r for r in variant_report(adapter).results}
        for case, stage in expected.items():
            for d in DTYPES:
                r = by[case, d]
                caught[d][0] += r.verdict == ERROR or (r.verdict == FAIL and r.first_failing_stage == stage)
                caught[d][1] += 1
    margin = {}
    for d in DTYPES:
        worst = max((st.worst_ratio or 0.0) for a in [*ALL_CORRECT.values(), *_OUTPUT_ONLY.values()]
                    for r in variant_report(a).results if r.dtype == d for st in r.stages if st.verdict in (PASS, FAIL))
        margin[d] = 1 / worst
    with capsys.disabled():
        print("\nkill list caught at its stage: "
              + ", ".join(f"{d} {a}/{b} = {a / b:.1%}" for d, (a, b) in caught.items())
              + "\ncorrect implementations' smallest margin: " + ", ".join(f"{d} {m:.3g}x" for d, m in margin.items()))
    assert all(a == b > 0 for a, b in caught.values()), caught
    assert all(m >= 2 for m in margin.values()), margin
