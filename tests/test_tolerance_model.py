"""Two-sided proof of the tolerance model.

(1) Correct implementations written differently pass every case in every
dtype, with a margin; (2) realistic bugs are each rejected, and the first
failing stage named is the stage where the bug is.
"""

from __future__ import annotations

import pytest

import mhaspec
from mhaspec.conformance import ERROR, FAIL
from mhaspec.spec import CATALOG

from .variants import BUGS, CORRECT

@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_implementations_pass_every_case_and_dtype(name):
    report = mhaspec.check(CORRECT[name], timeout=None)
    assert report.ok, report.table()
    assert len(report.results) == 4 * len(CATALOG)
    margin = report.smallest_margin()
    # A margin below 2 would mean a correct implementation comes close to failing.
    assert margin >= 2, f"{name}: smallest margin {margin:.3g}x"


@pytest.mark.parametrize("name", sorted(BUGS))
def test_realistic_bugs_are_rejected_at_the_right_stage(name):
    adapter, stage = BUGS[name]
    report = mhaspec.check(adapter, timeout=None)
    assert not report.ok, f"bug {name} was not caught"
    failing = [r for r in report.results if r.verdict == FAIL]
    assert failing, f"bug {name} only ever errored: {[r.message for r in report.results if r.verdict == ERROR][:2]}"
    wrong = {(r.case, r.dtype): r.first_failing_stage for r in failing if r.first_failing_stage != stage}
    assert not wrong, f"bug {name}: first failing stage should be {stage}, got {wrong}"


def test_no_max_subtraction_is_caught_where_exp_overflows():
    adapter, _ = BUGS["softmax_without_max_subtraction"]
    report = mhaspec.check(adapter, cases=["large_logits"], timeout=None)
    verdicts = {r.dtype: r.verdict for r in report.results}
    assert verdicts["float32"] == FAIL and verdicts["float16"] == FAIL
    assert report.result("large_logits", "float32").stage("attn_weights").nonfinite > 0


def test_float16_compute_is_caught_at_float32():
    adapter, _ = BUGS["float16_when_float32_asked"]
    report = mhaspec.check(adapter, dtypes=["float32"], timeout=None)
    assert all(r.verdict == FAIL and r.first_failing_stage == "q_proj" for r in report.results)
