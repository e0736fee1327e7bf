"""The variants' backward bugs are named (src/mhaspec/conformance/diagnose_variants.py: backward_hypotheses):
each diagnosed bug of the backward kill list (tests/backward_variant_zoo.py) gets its own name on the
variant cases in every dtype, no bug gets another's, and the correct implementations get none, even with
every stage marked failing."""

from __future__ import annotations

import pytest

from mhaspec.conformance import FAIL
from mhaspec.conformance.compare import StageResult
from mhaspec.conformance.diagnose import diagnose
from mhaspec.spec import DTYPES
from mhaspec.spec.stages import BACKWARD_STAGES, forward_stages

from .backward_variant_zoo import CORRECT, KILL_LIST
from .test_diagnose_variants import assert_named
from .variant_cases import variant_golden, variant_report, written_golden

pytestmark = pytest.mark.proofs  # it reads the judge's verdicts on the variant cases

#: backward kill-list bug -> the words its diagnosis starts with (after "STAGE: ")
NAMED = {
    "softcap_prime_missing": "softcap′ missing in the backward",
    "d_bias_first_batch_only": "d_bias from batch 0 only",
    "d_bias_summed_over_every_axis": "d_bias summed over the batch and the heads",
    "rope_back_rotation_plus_angle": "RoPE turned back by +θ",
    "rope_back_rotation_offset_ignored": "RoPE turned back from position 0",
    "rope_not_turned_back": "RoPE not turned back in the backward",
}


@pytest.mark.parametrize("bug", sorted(NAMED))
def test_a_diagnosed_backward_bug_is_named_in_every_dtype_and_never_another(bug):
    # unnamed: in bfloat16 a few cases whose gradients are too coarse to tell (measured: 5 of 76)
    assert_named(variant_report(KILL_LIST[bug][0], backward=True), bug, NAMED[bug])


@pytest.mark.parametrize("bug", sorted(set(KILL_LIST) - set(NAMED)))
def test_a_backward_bug_without_a_diagnosis_gets_no_name(bug):
    adapter, _ = KILL_LIST[bug]
    hinted = [(r.case, r.dtype, r.hints) for r in variant_report(adapter, backward=True).results if r.hints]
    assert not hinted, hinted


@pytest.mark.parametrize("name", ["plain", "flash_kernel"])
def test_a_correct_backward_gets_no_diagnosis_even_if_every_stage_were_failing(name):
    adapter, _ = CORRECT[name]
    golden_set, ids = variant_golden()
    for case_id in ids:
        golden = golden_set.load(case_id)
        for dtype in DTYPES:
            case = golden.case(dtype)
            returned = {**adapter.run(case), **adapter.backward(case)}
            names = [*forward_stages(golden.spec.config), *BACKWARD_STAGES]
            stages = [StageResult(s, FAIL) for s in names if s in returned]
            assert diagnose(golden, returned, dtype, stages) == [], (case_id, dtype)


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    return written_golden(["everything"], tmp_path_factory.mktemp("everything"))


def test_softcap_prime_from_the_post_bias_scores_is_named_where_a_bias_follows_the_softcap(everything):
    """No catalog case has softcap with a bias or ALiBi: tests/variant_cases.py's "everything" has both."""
    import mhaspec

    from .variant_cases import judged_variants

    golden, ids = everything
    adapter, _ = KILL_LIST["softcap_prime_from_post_bias_scores"]
    with judged_variants():
        report = mhaspec.check(adapter, cases=ids, golden=golden, timeout=None, isolate=False, backward=True)
    hints = {r.dtype: r.hints for r in report.results}
    assert all(r.verdict == FAIL for r in report.results), report.table()
    assert all(len(h) == 1 and h[0].split(": ", 1)[1].startswith("softcap′ from the post-bias scores")
               for h in hints.values()), hints
