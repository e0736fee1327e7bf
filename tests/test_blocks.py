"""Judging by blocks of query rows gives the verdicts of judging whole cases."""

from __future__ import annotations

import pytest

import mhaspec
from mhaspec.conformance import blocks

from mhaspec.adapters import Deviation

from .variants import BUGS, CORRECT, Variant

class UniformDeclared(Variant):
    known_deviations = [Deviation("uniform rows", stage=s, rows="fully_masked")
                        for s in ("attn_weights", "head_outputs", "concat", "output")]


CASES = ["custom_mask", "causal_bottom_right_t_gt_s", "key_padding", "gqa", "large_logits", "cross_shared_kv"]


@pytest.mark.parametrize("name", ["einsum", "causal_off_by_one", "mask_polarity_inverted", "heads_merged_without_transpose",
                                  "nan_on_fully_masked_rows", "output_bias_dropped",
                                  "uniform_declared"])
def test_blocks_give_the_same_verdicts(name, monkeypatch):
    if name == "uniform_declared":  # a row-scoped known deviation, decided block by block
        adapter = UniformDeclared(name="uniform", uniform_masked_rows=True)
    else:
        adapter = CORRECT[name] if name in CORRECT else BUGS[name][0]
    whole = mhaspec.check(adapter, dtypes=["float32", "bfloat16"], cases=CASES, timeout=None)
    monkeypatch.setattr(blocks, "MAX_BLOCK_ELEMENTS", 7)  # a few query rows per block, one batch entry
    split = mhaspec.check(adapter, dtypes=["float32", "bfloat16"], cases=CASES, timeout=None)
    for a, b in zip(whole.results, split.results):
        assert (a.case, a.dtype, a.verdict, a.first_failing_stage) == (b.case, b.dtype, b.verdict, b.first_failing_stage)
        for x, y in zip(a.stages, b.stages):
            assert (x.stage, x.verdict, x.compared, x.nonfinite) == (y.stage, y.verdict, y.compared, y.nonfinite)
            assert (x.max_abs_err, x.max_rel_err) == (y.max_abs_err, y.max_rel_err)
            # tolerances are matrix products, their non-negative sums formed in float32 and rounded up
            # (model.vocabulary.upper32): another block shape rounds them in another order, by <= γ₃₂(n) ≈ 1e-6
            assert x.worst_ratio == pytest.approx(y.worst_ratio, rel=1e-6)
            if x.worst_ratio is not None and x.worst_ratio > 0:
                assert x.worst_index == y.worst_index, (a.case, x.stage)
            if y.verdict == "fail":
                assert "[block: batch entry" in y.message


def test_a_block_is_plain_golden_data_and_its_judging_state_lives_while_it_is_judged():
    import dataclasses

    from mhaspec.conformance import judging
    from mhaspec.fixtures import GoldenSet

    golden = GoldenSet().load("gqa")
    B, H, T, S = golden.visible.shape
    block = blocks.block_case(golden, B - 1, 1, T)
    assert block.visible.shape == (1, H, T - 1, S) and type(block) is type(golden)
    assert {f.name for f in dataclasses.fields(block)} == {
        "spec", "inputs", "weights", "stages", "visible", "path", "d_output", "reference_error", "_cases", "sha256",
        "row_offset", "case_tgt_len"}
    assert (block.row_offset, block.whole_tgt_len, golden.row_offset, golden.whole_tgt_len) == (1, T, 0, T)
    assert blocks.block_case(block, 0, 1, T - 1).row_offset == 2  # a block of a block: rows of the case
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert judging.whole_shape(block) == (1, H, T - 1, S)  # not declared a block: a case of its own
    assert [judging.memoised(block, "k", compute) for _ in range(2)] == [1, 2]  # nothing kept
    memo: dict = {}
    with judging.judging_block(block, golden, memo) as judged:
        assert judged is block and judging.whole_shape(block) == (B, H, T, S)
        assert [judging.memoised(block, "k", compute) for _ in range(2)] == [3, 3]  # computed once
        other = blocks.block_case(golden, B - 1, 0, 1)
        with judging.judging_block(other, golden, memo):  # a sibling block of the same batch entry shares it
            assert judging.memoised(other, "k", compute) == 3 and judging.whole_shape(other) == (B, H, T, S)
        with pytest.raises(RuntimeError, match="already being judged"):
            with judging.judging_block(block, golden, memo):
                pass
    assert judging.whole_shape(block) == (1, H, T - 1, S) and judging.memoised(block, "k", compute) == 4
    assert not judging._BLOCKS  # nothing outlives the judging of a block


def test_the_rows_of_an_input_broadcast_over_the_batch_are_there_for_every_batch_entry():
    """A mask or bias of one batch entry (1, H|1, T|1, S) is every entry's: batch entry 1's rows of it are
    its rows (they were empty, x[1:1], before the fix that came with conformance/ranks.py)."""
    import numpy as np

    from mhaspec.spec.case import input_rows

    bias = np.arange(2 * 3 * 4, dtype=np.float64).reshape(1, 2, 3, 4)  # (1, H, T, S)
    for b in (0, 1, 2):
        np.testing.assert_array_equal(input_rows("bias", bias, b, 1, 3), bias[:, :, 1:3])
    mask = np.ones((1, 1, 1, 4), dtype=bool)  # (1, 1, 1, S): every row's
    assert input_rows("mask", mask, 2, 1, 3).shape == (1, 1, 1, 4)
    per_entry = np.arange(3 * 2 * 3 * 4, dtype=np.float64).reshape(3, 2, 3, 4)
    np.testing.assert_array_equal(input_rows("bias", per_entry, 2, 0, 2), per_entry[2:3, :, 0:2])
