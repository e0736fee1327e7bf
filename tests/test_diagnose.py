"""The hints added to a failing case name the bug from the registry's facts about each stage: heads
are looked for where a stage holds one slice per query head, blind query rows from the softmax on."""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.conformance.compare import FAIL, StageResult
from mhaspec.conformance.diagnose import AFTER_SOFTMAX, PER_HEAD_STAGES, diagnose
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import REGISTRY, STAGE, STAGES

GOLDEN = GoldenSet()


def _heads_rolled(golden, stage: str) -> np.ndarray:
    """The golden ``stage`` with its query heads rolled by one (head h holds golden head h - 1)."""
    x = golden.stages[stage]
    H = golden.spec.config.H
    axis = REGISTRY[stage].heads
    if REGISTRY[stage].head_axis_first:
        return np.roll(x, 1, axis=axis)
    split = x.reshape(*x.shape[:-1], H, -1)
    return np.roll(split, 1, axis=split.ndim - 2).reshape(x.shape)


def test_the_stages_looked_at_are_the_ones_the_registry_names():
    assert PER_HEAD_STAGES == (STAGE.scores, STAGE.attn_weights, STAGE.head_outputs, STAGE.concat)
    assert AFTER_SOFTMAX == (STAGE.attn_weights, STAGE.head_outputs, STAGE.concat, STAGE.output)


@pytest.mark.parametrize("stage", [s for s in STAGES if REGISTRY[s].heads is not None])
def test_heads_in_the_wrong_order_are_named_where_a_stage_holds_one_slice_per_query_head(stage):
    golden = GOLDEN.load("causal_square")  # H = 4: a roll by one is a permutation, not the identity
    returned = {stage: _heads_rolled(golden, stage)}
    hints = diagnose(golden, returned, "float32", [StageResult(stage, FAIL)])
    named = [h for h in hints if "heads in the wrong order" in h]
    if stage in PER_HEAD_STAGES:
        assert named == [f"{stage}: heads in the wrong order: returned head h is golden head perm[h], "
                         f"perm = [3, 0, 1, 2] (a head axis split or merged in the wrong order)"]
    else:  # the projections: their head order is the layer's own, not a bug of attention
        assert not named, hints


def test_uniform_attention_on_the_rows_that_see_no_key_is_named_from_the_softmax_on():
    golden = GOLDEN.load("self_masked_rows")
    blind = ~golden.visible.any(axis=-1)  # (B, H, T)
    weights = golden.stages[STAGE.attn_weights].copy()
    weights[blind] = 1.0 / weights.shape[-1]
    hints = diagnose(golden, {STAGE.attn_weights: weights}, "float32", [StageResult(STAGE.attn_weights, FAIL)])
    assert len(hints) == 1 and hints[0].startswith(f"{STAGE.attn_weights}: the {int(blind.sum())} query row(s) "
                                                   "that see no key attend uniformly"), hints
    scores = golden.stages[STAGE.scores].copy()
    scores[blind] = 0.0  # not a stage after the softmax: no blind-rows hint
    hints = diagnose(golden, {STAGE.scores: scores}, "float32", [StageResult(STAGE.scores, FAIL)])
    assert not [h for h in hints if "see no key" in h], hints
