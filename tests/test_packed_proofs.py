"""Two-sided proof of per-sequence judging of packed cases, per dtype (issue 32; docs/serving.md).

On the built-in catalog's packed cases and tests/packed_zoo.py's own, in every dtype, through ``run(case)``
and the runner's per-sequence judging: (1) every correct packed implementation of tests/packed_zoo.py
(CORRECT: one packed (1, N) call with a block-diagonal rule, one call per sequence, the padded layout with
its padding zeroed) passes every sequence with a margin — the unchanged tolerance model on each sequence's
view; (2) every bug of the kill list (KILL_LIST: the NaN padding read by P·V under a mask, padding attended,
a neighbouring sequence attended through
cu_seqlens off by one or a missing block-diagonal mask, RoPE positions continuing across sequences) fails
on every case and dtype where it changes the float64 result, first at the sequence and stage where it
changes it first, and passes where it changes nothing.  The figures: benchmarks/packed_figures.py.
"""

from __future__ import annotations

import pytest

from mhaspec.conformance import PASS
from mhaspec.spec import DTYPES

from .decode_zoo import misplaced
from .packed_zoo import CORRECT, KILL_LIST, expected_sequences, packed_goldens, packed_results

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_packed_implementations_pass_every_sequence_in_every_dtype(name):
    results = packed_results(CORRECT[name])
    lengths = [golden.load(cid).spec.seq_lens for golden, ids in packed_goldens() for cid in ids]
    assert len(results) == len(DTYPES) * len(lengths)
    failing = [(r.case, r.dtype, r.verdict, r.message) for r in results if r.verdict != PASS]
    assert not failing, failing
    sequences = [s for r in results for s in r.calls]
    assert len(sequences) == len(DTYPES) * sum(map(len, lengths))
    assert all(s.verdict == PASS and s.kind == "sequence" for s in sequences)
    worst = max((s.worst_ratio or 0.0) for s in sequences)
    # a worst ratio above 1/2 would mean a correct implementation comes close to failing
    assert worst <= 0.5, f"{name}: worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"


@pytest.mark.parametrize("name", sorted(KILL_LIST))
def test_a_kill_list_bug_is_caught_at_its_sequence_and_stage_in_every_dtype(name):
    impl = KILL_LIST[name]
    expected = expected_sequences(impl)
    assert expected, f"{name} changes no packed case in float64"
    wrong = misplaced(expected, packed_results(impl), "sequence")
    assert not wrong, f"{name}:\n" + "\n".join(wrong)
