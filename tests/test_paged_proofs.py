"""Two-sided proof of judging paged KV caches, per dtype (issue 32; docs/serving.md "Paged caches").

On the built-in catalog's paged cases and tests/paged_zoo.py's own (a past with RoPE and key padding,
GQA with a window over 2-key pages, B = 3), in every dtype, through ``decode(case)`` and the runner's
per-call judging: (1) every correct paged decode (CORRECT_PAGED: a recycled or a NaN-filled pool, writes
row by row or as page slices, split-key decoding) passes every call with a margin; (2) every bug of the
paged kill list (PAGED_KILL_LIST: a page or a slot read off by one, a stale page, a write into another
batch entry's page) fails on every case and dtype where it changes the float64 result, first at the call
and stage where it changes it first, and passes where it changes nothing; (3) what only the pool would
show (POOL_ONLY) changes no value a call reads, and passes.  The figures: benchmarks/decode_figures.py.
"""

from __future__ import annotations

import pytest

from mhaspec.conformance import FAIL, PASS
from mhaspec.spec import DTYPES

from .decode_zoo import decode_results, expected_calls, first_failing_call
from .paged_zoo import CORRECT_PAGED, PAGED_KILL_LIST, POOL_ONLY_IMPLS, paged_goldens

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)


@pytest.mark.parametrize("name", sorted(CORRECT_PAGED))
def test_correct_paged_decodes_pass_every_call_in_every_dtype(name):
    results = decode_results(CORRECT_PAGED[name], paged_goldens)
    schedules = [golden.load(cid).case("float64").calls() for golden, ids in paged_goldens() for cid in ids]
    assert len(schedules) >= 5 and len(results) == len(DTYPES) * len(schedules)
    failing = [(r.case, r.dtype, r.verdict, r.message) for r in results if r.verdict != PASS]
    assert not failing, failing
    calls = [c for r in results for c in r.calls]
    assert len(calls) == len(DTYPES) * sum(map(len, schedules)) and all(c.verdict == PASS for c in calls)
    worst = max((c.worst_ratio or 0.0) for c in calls)
    assert worst <= 0.5, f"{name}: worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


@pytest.mark.parametrize("name", sorted(PAGED_KILL_LIST))
def test_a_paged_kill_list_bug_is_caught_at_its_call_and_stage_in_every_dtype(name):
    impl = PAGED_KILL_LIST[name]
    expected = expected_calls(impl, paged_goldens)
    assert expected, f"{name} changes no paged case in float64"
    wrong = []
    for result in decode_results(impl, paged_goldens):
        if result.case in expected:
            got = (result.verdict, first_failing_call(result), result.first_failing_stage)
            want = (FAIL, expected[result.case], expected[result.case][1])
        else:  # the bug changes nothing here: nothing to catch
            got, want = result.verdict, PASS
        if got != want:
            wrong.append(f"{result.case} {result.dtype}: got {got}, expected {want}")
    assert not wrong, f"{name}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(POOL_ONLY_IMPLS))
def test_what_only_the_pool_shows_changes_no_value_a_call_reads(name):
    impl = POOL_ONLY_IMPLS[name]
    assert expected_calls(impl, paged_goldens) == {}
    assert {r.verdict for r in decode_results(impl, paged_goldens)} == {PASS}
