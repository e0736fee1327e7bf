"""The attention variants' bugs are named (src/mhaspec/conformance/diagnose_variants.py): each diagnosed
bug of the kill list (tests/variants.py) gets its own name on the variant cases in every dtype, no bug
gets another's, and the correct implementations get none, even with every stage marked failing."""

from __future__ import annotations

import pytest

from mhaspec.conformance import FAIL
from mhaspec.conformance.compare import StageResult
from mhaspec.conformance.diagnose import diagnose
from mhaspec.spec import DTYPES
from mhaspec.spec.stages import forward_stages

from .variant_cases import variant_golden, variant_report
from .variants import CORRECT, KILL_LIST, OUTPUT_ONLY_KILL_LIST, VARIANT_CORRECT

pytestmark = pytest.mark.proofs  # it reads the judge's verdicts on the variant cases

#: kill-list bug -> the words its diagnosis starts with (after "STAGE: ")
NAMED = {
    "window_left_off_by_one": "window off by one (window_left",
    "window_right_off_by_one": "window off by one (window_right",
    "window_aligned_top_left": "window aligned top-left instead of bottom-right",
    "softcap_missing": "softcap missing",
    "softcap_before_scale": "softcap applied before the scale",
    "alibi_wrong_sign": "ALiBi with the wrong sign",
    "alibi_wrong_anchor": "ALiBi anchored at column 0",
    "sink_missing_from_denominator": "sink missing from the softmax's denominator",
    "rope_styles_swapped": "RoPE style swapped",
    "rope_offset_ignored": "RoPE positions without their offset",
    "rope_rotary_dim_ignored": "rotary_dim ignored",
    "lse_in_base_2": "LSE in base 2 (natural log expected: lse = lse₂·ln 2)",
}


def _named(hint: str) -> str:
    return hint.split(": ", 1)[1]


def assert_named(report, bug: str, words: str) -> None:
    """Every failing case×dtype of ``report`` (bug ``bug``'s) has at most one hint, starting with ``words``;
    some in every dtype, and at least 3 in 4 of them."""
    failing = [r for r in report.results if r.verdict == FAIL]
    for r in failing:
        assert all(_named(h).startswith(words) for h in r.hints), (r.case, r.dtype, r.hints)
        assert len(r.hints) <= 1, (r.case, r.dtype, r.hints)
    named = [r for r in failing if r.hints]
    assert {r.dtype for r in named} == set(DTYPES), f"{bug} is not named in some dtype"
    assert len(named) >= 0.75 * len(failing), f"{bug}: named on {len(named)} of {len(failing)} failing case×dtype"


@pytest.mark.parametrize("bug", sorted(NAMED))
def test_a_diagnosed_bug_is_named_in_every_dtype_and_never_another(bug):
    # unnamed: where the bug leaves no finite value to read (a window of 0 keys off by one: every row
    # sees none), or, in bfloat16, a window's lse and weights too coarse to tell (measured: 3 of 36)
    assert_named(variant_report(KILL_LIST[bug][0]), bug, NAMED[bug])


@pytest.mark.parametrize("bug", sorted(set(KILL_LIST) - set(NAMED)) + sorted(OUTPUT_ONLY_KILL_LIST))
def test_a_bug_without_a_diagnosis_gets_no_name(bug):
    adapter, _ = {**KILL_LIST, **OUTPUT_ONLY_KILL_LIST}[bug]
    hinted = [(r.case, r.dtype, r.hints) for r in variant_report(adapter).results if r.hints]
    assert not hinted, hinted


@pytest.mark.parametrize("name", ["einsum", "tiled_online_softmax", *sorted(VARIANT_CORRECT)])
def test_a_correct_implementation_gets_no_diagnosis_even_if_every_stage_were_failing(name):
    adapter = {**CORRECT, **VARIANT_CORRECT}[name]
    golden_set, ids = variant_golden()
    for case_id in ids:
        golden = golden_set.load(case_id)
        for dtype in DTYPES:
            returned = adapter.run(golden.case(dtype))
            stages = [StageResult(s, FAIL) for s in forward_stages(golden.spec.config) if s in returned]
            assert diagnose(golden, returned, dtype, stages) == [], (case_id, dtype)
