"""The variant zoo (tests/variants.py: VARIANT_CORRECT, KILL_LIST) against the exact reference in
float64, before any tolerance: every correct implementation agrees within a few float64 ulps, every
bug of the kill list changes the float64 result, first at one of the stages it is named by, on the
cases where it applies and only there.  The judge's verdicts per dtype: tests/test_variant_proofs.py."""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.spec.stages import forward_stages

from .test_numpy_variants import U, error_in_units
from .variant_cases import CASES, exact, first_changed_stage, spec_of
from .variants import CORRECT, KILL_LIST, VARIANT_CORRECT

#: the kill list's bugs and the cases whose fields they need (a bug cannot change a case without them)
NEEDS = {
    "window": ("window_left", "window_right"), "softcap": ("softcap",), "alibi": ("alibi_slopes",),
    "sink": ("sinks",), "rope": ("rope",), "lse": (),
}


@pytest.mark.parametrize("name", sorted({**CORRECT, **VARIANT_CORRECT}))
def test_correct_implementations_agree_with_the_exact_reference_in_float64(name):
    adapter = {**CORRECT, **VARIANT_CORRECT}[name]
    for case in CASES:
        got, want = adapter.run(spec_of(case).case("float64")), exact(case)
        assert set(got) <= set(forward_stages(spec_of(case).config)) and "lse" in got, case
        for stage, value in got.items():
            # measured: at most 6 ulps of the stage's magnitude; 8 leaves room
            assert error_in_units(value, want[stage], U) <= 8, (case, stage)


@pytest.mark.parametrize("name", sorted(KILL_LIST))
def test_each_bug_changes_float64_first_at_its_stage_where_it_applies(name):
    adapter, stages = KILL_LIST[name]
    feature = next(f for f in NEEDS if f in name)
    changed = {}
    for case in CASES:
        spec = spec_of(case)
        stage = first_changed_stage(adapter, spec.case("float64"), exact(case))
        uses = not NEEDS[feature] or any(getattr(spec.config, f) is not None and getattr(spec.config, f) is not False
                                         for f in NEEDS[feature])
        if stage is not None:
            assert uses, f"{name} changes {case}, which does not use {feature}"
            assert stage in stages, f"{name} on {case}: first changed stage {stage}, expected one of {stages}"
            changed[case] = stage
    assert changed, f"{name} changes no case"


@pytest.mark.parametrize("name, cases", [
    ("window_left_off_by_one", {"window", "mistral", "gemma2", "gpt_oss", "window_zero"}),
    ("window_right_off_by_one", {"window", "window_zero"}),
    ("window_aligned_top_left", {"window_causal_br", "window_t_gt_s", "gpt_oss_long"}),
    ("softcap_missing", {"softcap", "softcap_large_logits", "gemma2"}),
    ("softcap_after_mask", {"gemma2"}),  # a softcap with masked keys
    ("alibi_wrong_anchor", {"alibi_standard", "alibi_list_br", "bloom"}),
    ("sink_with_a_value", {"sinks", "sinks_masked_rows", "gpt_oss"}),
    ("rope_offset_ignored", {"rope_offsets_gqa", "llama3_partial"}),
    ("rope_rotary_dim_ignored", {"rope_interleaved_partial", "llama3_partial"}),
    ("lse_in_base_2", {"window", "sinks", "t5"}),
])
def test_named_cases_see_the_bug(name, cases):
    adapter, _ = KILL_LIST[name]
    for case in cases:
        assert first_changed_stage(adapter, spec_of(case).case("float64"), exact(case)) is not None, case


def test_alibi_anchored_at_column_0_changes_only_the_scores_and_lse_of_a_causal_case():
    """+slope·j and −slope·|i + off − j| differ by a constant per row where j ≤ i + off: the softmax
    cancels it (docs/spec.md "ALiBi anchor")."""
    adapter, _ = KILL_LIST["alibi_wrong_anchor"]
    got, want = adapter.run(spec_of("bloom").case("float64")), exact("bloom")
    assert error_in_units(got["attn_weights"], want["attn_weights"], U) <= 8
    assert error_in_units(got["output"], want["output"], U) <= 8
    assert error_in_units(got["lse"], want["lse"], U) > 1e6
    assert first_changed_stage(adapter, spec_of("alibi_list_br").case("float64"), exact("alibi_list_br")) == "scores"


def test_the_online_softmax_crosses_key_blocks_with_sinks_and_a_window():
    adapter = VARIANT_CORRECT["online_softmax_sinks_window_lse_weights"]
    spec = spec_of("gpt_oss_long")
    assert adapter.block < spec.src_len and spec.config.sinks and spec.config.window_left is not None
    got = adapter.run(spec.case("float64"))
    assert np.all(got["attn_weights"].sum(axis=-1) < 1)  # the sink's share
