"""Two-sided proofs of the sharded runs' judging (issue 33): every bug of the kill list (tests/rank_zoo.py)
is caught at the rank, ring step and stage where it changes the result, and the correct numpy distributed
adapters pass.

Part one (float64, tolerance-free): where each bug changes each rank's stages against the rank's exact
golden (reference/ranks.py), as its definition says it must.  Part two (the judge, conformance/ranks.py,
through mhaspec.conformance.check on the threads launcher, every dtype): each bug fails exactly the ranks it
changes, each at the stage and ring step it changes first, named in the verdict; the correct adapters pass
every catalog case they shard.  The figures: benchmarks/rank_figures.py.
"""

from __future__ import annotations

import pytest

from mhaspec.conformance import FAIL, PASS
from mhaspec.spec import CATALOG
from mhaspec.spec.ranks import kv_head_range

from tests.rank_zoo import (CORRECT, DTYPES, REACH, BiasOnEveryRank, DuplicatedAllReduce, KvHeadsSliced,
                            LocalCausalOffsets, LseAdded, MissingAllReduce, RingWrongSource, UlyssesSharesReversed,
                            ZigzagWrongOrder, correct_cases, float64_changes, judged)

pytestmark = pytest.mark.proofs

def changed(bug: type, world: int) -> dict[str, dict[int, str]]:
    """{case: {rank: the first stage the bug changes}} in float64, for the cases of REACH at ``world``."""
    return {case: {r: stage for r, (stage, _) in ranks.items()} for case, ranks in float64_changes(bug, world).items()}


def first_steps(bug: type, world: int, case: str) -> dict[int, int | None]:
    """{rank: the first ring step whose ring_out or ring_lse the bug changes (None: none)} in float64; the
    ranks it does not change are left out."""
    return {r: step for r, (_, step) in float64_changes(bug, world)[case].items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bug, stage", [(BiasOnEveryRank, "o_partial"), (MissingAllReduce, "output"),
                                        (DuplicatedAllReduce, "output"), (ZigzagWrongOrder, "q_proj"),
                                        (UlyssesSharesReversed, "concat")])
def test_a_bug_of_every_rank_changes_its_stage_on_every_rank(bug, stage, world):
    """b_o on every rank: each o_partial has b_o; no or two all-reduces: each output; zigzag chunks swapped:
    each rank's rows (q_proj first); Ulysses' shares reversed: each concat."""
    for case, ranks in changed(bug, world).items():
        assert ranks == dict.fromkeys(range(world), stage), (case, ranks)


def test_kv_heads_sliced_changes_the_ranks_that_took_another_head():
    """H_kv < tp only (tp 4): rank t took key/value head t mod H_kv; it differs where that is not the head its
    query heads read — there k_proj is its first wrong stage; the others are wrong only after the all-reduce."""
    assert changed(KvHeadsSliced, 2) == {"gqa": {}, "gemma2_softcap_window": {}}  # H_kv >= tp: nothing sliced
    layout = KvHeadsSliced().layout(4)
    for case, ranks in changed(KvHeadsSliced, 4).items():
        cfg = CATALOG[case].config
        took_another = {t for t in range(4) if t % cfg.H_kv != kv_head_range(layout, cfg, t)[0]}
        assert took_another and {r for r, s in ranks.items() if s == "k_proj"} == took_another, (case, ranks)
        assert all(ranks[r] == "output" for r in set(range(4)) - took_another), (case, ranks)


@pytest.mark.parametrize("world", [2, 4])
def test_local_causal_offsets_change_a_later_ring_step_never_the_first(world):
    """Step 0 holds the rank's own chunk, whose local diagonal is the global one (T = S, contiguous); a held
    chunk of another rank is drawn at local positions: every rank's result changes at a later step."""
    steps = first_steps(LocalCausalOffsets, world, "bloom_alibi")
    assert sorted(steps) == list(range(world)) and all(k is not None and k >= 1 for k in steps.values()), steps


@pytest.mark.parametrize("world", [2, 4])
def test_an_lse_added_changes_the_first_merge_of_two_non_empty_sides(world):
    """bloom_alibi (causal, no sinks): rank c's first merge of two non-empty sides is step 1 (its own chunk,
    then chunk c − 1); rank 0 holds only later chunks after step 0, all invisible: the bug changes nothing there."""
    assert first_steps(LseAdded, world, "bloom_alibi") == dict.fromkeys(range(1, world), 1)


def test_an_lse_added_with_sinks_changes_step_zero():
    """gpt_oss_sinks_window (sinks): the running LSE starts at the sink logit, so the first merge already adds."""
    assert first_steps(LseAdded, 2, "gpt_oss_sinks_window") == {0: 0, 1: 0}


def test_a_ring_turned_the_wrong_way_is_invisible_at_two_ranks_and_wrong_at_four():
    """At step k ≥ 1 the held keys are put at the positions of rank (c + k) mod cp.  Rank 0 (causal) sees none of
    the chunks it misplaces: only its masked scores move, which no one compares; every other rank's scores move
    at step 1."""
    assert changed(RingWrongSource, 2) == {"bloom_alibi": {}}  # (c + 1) mod 2 = (c − 1) mod 2
    assert changed(RingWrongSource, 4) == {"bloom_alibi": dict.fromkeys((1, 2, 3), "scores")}
    assert first_steps(RingWrongSource, 4, "bloom_alibi") == dict.fromkeys((1, 2, 3), 1)


# -- part two: the judge, every dtype ---------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bug", list(REACH), ids=lambda b: b.name)
def test_a_kill_list_bug_is_caught_at_its_rank_step_and_stage_in_every_dtype(bug, world):
    expected = float64_changes(bug, world)
    wrong = []
    for res in judged(bug(), world, REACH[bug]):
        where = f"{res.case} {res.dtype}"
        changes = expected[res.case]
        if not changes:  # the bug changes nothing at this world (e.g. a two-rank ring turned either way)
            if res.verdict != PASS:
                wrong.append(f"{where}: {res.verdict}, but the bug changes nothing here ({res.message})")
            continue
        failing = {r.rank: (r.first_failing_stage, r.step) for r in res.ranks if r.verdict == FAIL}
        ring = {r.rank: next((int(s.stage[9:-1]) for s in r.stages if s.verdict == FAIL and s.stage.startswith("ring_")),
                             None) for r in res.ranks}
        got = {r: (failing[r][0], ring[r]) for r in failing}
        if res.verdict != FAIL or got != changes:
            wrong.append(f"{where}: {res.verdict}, ranks (first failing stage, first failing ring step) {got}, "
                         f"expected {changes}")
        first = min(changes)
        if f"rank {first} of {world}" not in res.message or f"{changes[first][0]} fails" not in res.message:
            wrong.append(f"{where}: the verdict does not name rank {first} and {changes[first][0]}: {res.message}")
    assert not wrong, f"{bug.name} world {world}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", CORRECT)
def test_a_correct_adapter_passes_every_case_it_shards_in_every_dtype(name, world):
    results = judged(name, world, correct_cases(name, world))
    assert len(results) == len(DTYPES) * len(correct_cases(name, world)) > 0
    failing = [(r.case, r.dtype, r.verdict, r.message) for r in results if r.verdict != PASS]
    assert not failing, failing
    worst = max(r.worst_ratio or 0.0 for r in results)
    assert worst <= 0.5, f"{name} world {world}: worst error/tolerance {worst:.3g} (margin {1 / worst:.3g}x)"
