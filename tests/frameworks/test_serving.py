"""The serving adapters (docs/serving.md): keras-hub's CachedMultiHeadAttention (keras-hub-cached) and HF
transformers' LlamaAttention with DynamicCache (hf-llama-cache), driven call by call through their own caches:
the masks they need per call, their verdicts on the catalog's schedule cases, a bug of each kind caught at the
right call, and the cause of what they declare (tox's serving env)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require
from tests.decode_zoo import first_failing_call
from tests.frameworks.helpers import assert_decode_matches_run, check_here, golden_case

import mhaspec
from mhaspec.conformance import FAIL, KNOWN_DEVIATION, PASS, UNSUPPORTED
from mhaspec.spec import CATALOG

pytestmark = pytest.mark.serving

SCHEDULE_CASES = [spec.id for spec in CATALOG if spec.schedule is not None]


@pytest.fixture(scope="module")
def keras_hub_cached():
    require("keras_hub")
    from mhaspec.adapters import keras_hub_cached

    return keras_hub_cached


@pytest.fixture(scope="module")
def hf_llama_cache():
    require("transformers")
    require("torch")
    from mhaspec.adapters import hf_llama_cache

    return hf_llama_cache


def verdicts(report) -> dict[tuple[str, str], str]:
    return {(r.case, r.dtype): r.verdict for r in report.results}


# -- keras-hub-cached ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "cache", "S"), [(5, 5, 11), (1, 6, 11), (4, 8, 11), (2, 6, 10)])
def test_keras_hubs_causal_mask_at_the_cache_index_is_the_bottom_right_band(keras_hub_cached, rows, cache, S):
    # compute_causal_mask(B, S, n_c, cache_index = L_c − n_c): query i sees keys j <= L_c − n_c + i of the whole
    # preallocated cache, so the rows not written yet (j >= L_c) are hidden and the diagonal is bottom-right.
    case = golden_case("decode_prefill_steps")
    mask = np.asarray(keras_hub_cached.causal_mask(case.model_copy(update={"src_len": S}), rows, cache - rows))
    i, j = np.arange(rows)[:, None], np.arange(S)[None, :]
    assert mask.shape == (case.batch, rows, S)
    np.testing.assert_array_equal(mask[0], j <= i + cache - rows)
    assert not mask[:, :, cache:].any()


def test_keras_hub_cached_decode_is_its_own_full_pass(keras_hub_cached):
    adapter = keras_hub_cached.KerasHubCachedAdapter()
    for case_id in ("decode_prefill_steps", "decode_chunked_prefill", "decode_with_past"):
        assert_decode_matches_run(adapter, golden_case(case_id, "float32"), 1e-5)


def test_keras_hub_cached_conforms_on_the_schedule_cases() -> None:
    report = check_here("keras-hub-cached", cases=SCHEDULE_CASES)
    got = verdicts(report)
    for case_id in ("decode_prefill_steps", "decode_chunked_prefill", "decode_with_past"):
        for dtype in ("float32", "float16", "bfloat16"):
            assert got[case_id, dtype] == PASS, (case_id, dtype, str(report))
        # float64: keras's scale 1/sqrt(D_k) taken in float32 where it is not a float32 number (D_k = 5, 6)
        assert got[case_id, "float64"] in (PASS, KNOWN_DEVIATION), str(report)
    for case_id in ("decode_gqa_rope", "decode_window"):  # GQA is not MultiHeadAttention; RoPE, window undeclared
        assert {got[case_id, d] for d in ("float64", "float32", "float16", "bfloat16")} == {UNSUPPORTED}, case_id
    for r in report.results:
        if r.verdict == PASS:
            assert r.calls and {c.verdict for c in r.calls} == {PASS}, r.case


def test_keras_hub_mask_without_the_cache_index_fails_at_the_first_decode_step(keras_hub_cached, monkeypatch):
    # A decoder that builds its mask with cache_index 0 on every call (the top-left diagonal within the
    # cache): the prefill (cache_index 0 is right there) passes, the first decode step sees key 0 only.
    correct = keras_hub_cached.causal_mask
    monkeypatch.setattr(keras_hub_cached, "causal_mask", lambda case, rows, index: correct(case, rows, 0))
    report = mhaspec.check(keras_hub_cached.KerasHubCachedAdapter(), dtypes=["float32", "bfloat16"],
                           cases=["decode_prefill_steps"], isolate=False)
    for r in report.results:
        assert r.verdict == FAIL and first_failing_call(r) == (1, "output"), str(report)


# -- hf-llama-cache ------------------------------------------------------------------------------------


def chunked_catalog(folder: Path) -> Path:
    """Chunked prefills LlamaAttention can run (an even head_dim; the catalog's decode_chunked_prefill has 5):
    B 2, T = S = 11 in calls of 4, 4, 3, without and with key padding."""
    base = {"config": {"d_model": 16, "num_heads": 4, "causal": True, "causal_alignment": "bottom_right"},
            "batch": 2, "tgt_len": 11, "src_len": 11, "inputs": "self", "seed": 7, "schedule": [4, 4, 3]}
    cases = [{"id": "llama_chunked", **base},
             {"id": "llama_chunked_padded", **base, "mask": {"kind": "key_padding", "lengths": [11, 6]}}]
    path = folder / "llama_chunked.json"
    path.write_text(json.dumps(cases))
    return path


def test_hf_llama_cache_on_the_schedule_cases() -> None:
    report = check_here("hf-llama-cache", cases=SCHEDULE_CASES)
    got = verdicts(report)
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        assert got["decode_prefill_steps", dtype] == PASS, str(report)
        # RoPE: Llama's own (half, theta 10000); float64 is the declared float32 angles
        assert got["decode_gqa_rope", dtype] == (KNOWN_DEVIATION if dtype == "float64" else PASS), str(report)
        assert got["decode_chunked_prefill", dtype] == UNSUPPORTED  # head_dim 5: LlamaConfig refuses it
        assert got["decode_with_past", dtype] == UNSUPPORTED  # distinct query/key/value inputs
        assert got["decode_window", dtype] == UNSUPPORTED  # no sliding window in Llama


def test_hf_llama_cache_chunked_prefill_with_the_models_mask_conforms(tmp_path) -> None:
    from mhaspec.reference.onthefly import OnTheFlyGolden

    golden = OnTheFlyGolden(chunked_catalog(tmp_path))
    report = mhaspec.check("hf-llama-cache", golden=golden, isolate=False)
    assert {r.verdict for r in report.results} == {PASS}, str(report)
    assert all(len(r.calls) == 3 for r in report.results)


def test_hf_llama_attention_without_a_mask_fails_the_chunked_call(hf_llama_cache, tmp_path, monkeypatch) -> None:
    # A user calling LlamaAttention with attention_mask=None (no create_causal_mask): HF's SDPA path sets
    # is_causal for q_len > 1, the top-left diagonal within the call. The prefill (L_c = n_c) and the decode
    # steps (n_c = 1: no mask needed) would pass; the second chunk (4 rows against 8 keys) fails.
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "create_causal_mask", lambda **kwargs: None)
    from mhaspec.reference.onthefly import OnTheFlyGolden

    golden = OnTheFlyGolden(chunked_catalog(tmp_path))
    report = mhaspec.check(hf_llama_cache.HFLlamaCacheAdapter(), golden=golden, cases=["llama_chunked"],
                           dtypes=["float32", "bfloat16"], isolate=False)
    for r in report.results:
        assert r.verdict == FAIL and first_failing_call(r) == (1, "output"), str(report)


def test_hf_llama_rope_in_float32_is_the_declared_cause(hf_llama_cache, monkeypatch) -> None:
    import torch
    from transformers.models.llama import modeling_llama

    bare = type("Bare", (hf_llama_cache.HFLlamaCacheAdapter,), {"known_deviations": []})()
    failed = mhaspec.check(bare, dtypes=["float64"], cases=["decode_gqa_rope"], isolate=False)
    assert failed.result("decode_gqa_rope", "float64").first_failing_stage == "k_rot", str(failed)

    def forward(self, x, position_ids):  # LlamaRotaryEmbedding.forward with the frequencies and angles in x's dtype
        dim, theta = self.config.head_dim, self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=x.dtype) / dim)
        freqs = position_ids[..., None].to(x.dtype) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", forward)
    fixed = mhaspec.check(bare, dtypes=["float64"], cases=["decode_gqa_rope"], isolate=False)
    assert fixed.result("decode_gqa_rope", "float64").verdict == PASS, str(fixed)
