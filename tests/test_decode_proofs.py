"""Two-sided proof of per-call judging of decode schedules, per dtype (issue 32; docs/serving.md).

On the built-in catalog's schedule cases in every dtype, through ``decode(case)`` and the runner's
per-call judging: (1) every correct decode of tests/decode_zoo.py (CORRECT: appended or preallocated
cache, a float32 cache rounded when read, sub-chunked calls, split-key decoding) passes every call
with a margin; (2) every bug of the kill list (KILL_LIST) fails on every case and dtype where it
changes the float64 result, first at the call and stage where it changes it first, and passes where
it changes nothing.  The figures: benchmarks/decode_figures.py.
"""

from __future__ import annotations

import pytest

from mhaspec.conformance import PASS
from mhaspec.spec import DTYPES

from .decode_zoo import CORRECT, KILL_LIST, decode_goldens, decode_results, expected_calls, misplaced

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)


def worst_ratio(results) -> float:
    """The largest error/tolerance over every judged call of the results (1 / the smallest margin)."""
    return max((c.worst_ratio or 0.0) for r in results for c in r.calls)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_decodes_pass_every_call_in_every_dtype(name):
    results = decode_results(CORRECT[name])
    schedules = [golden.load(cid).case("float64").calls() for golden, ids in decode_goldens() for cid in ids]
    assert len(results) == len(DTYPES) * len(schedules)
    failing = [(r.case, r.dtype, r.verdict, r.message) for r in results if r.verdict != PASS]
    assert not failing, failing
    calls = [c for r in results for c in r.calls]
    assert len(calls) == len(DTYPES) * sum(map(len, schedules)) and all(c.verdict == PASS for c in calls)
    worst = worst_ratio(results)
    # a worst ratio above 1/2 would mean a correct implementation comes close to failing
    assert worst <= 0.5, f"{name}: worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


@pytest.mark.parametrize("name", sorted(KILL_LIST))
def test_a_kill_list_bug_is_caught_at_its_call_and_stage_in_every_dtype(name):
    impl = KILL_LIST[name]
    expected = expected_calls(impl)
    assert expected, f"{name} changes no schedule case in float64"
    wrong = misplaced(expected, decode_results(impl))
    assert not wrong, f"{name}:\n" + "\n".join(wrong)
