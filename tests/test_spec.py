"""The spec models: defaults resolved once, inconsistent configs named, the catalog."""

from __future__ import annotations

import hashlib
import json
import math

import ml_dtypes
import numpy as np
import pydantic
import pytest

from mhaspec.errors import SpecError
from mhaspec.spec import CATALOG, Catalog, CaseSpec, MHAConfig, load_catalog_file
from mhaspec.spec.data import dyadic_tensor


def test_defaults_are_resolved_from_design_table():
    cfg = MHAConfig(d_model=12, num_heads=3)
    assert (cfg.kdim, cfg.vdim, cfg.num_kv_heads) == (12, 12, 3)
    assert (cfg.head_dim, cfg.value_head_dim, cfg.out_dim) == (4, 4, 12)
    assert cfg.scale == 1 / math.sqrt(4)
    assert (cfg.causal, cfg.causal_alignment, cfg.bias) == (False, "top_left", True)


def test_explicit_sizes_are_kept():
    cfg = MHAConfig(d_model=12, num_heads=3, head_dim=5, value_head_dim=7, out_dim=11, kdim=10, vdim=14)
    assert cfg.weight_shapes() == {
        "w_q": (12, 15), "w_k": (10, 15), "w_v": (14, 21), "w_o": (21, 11),
        "b_q": (15,), "b_k": (15,), "b_v": (21,), "b_o": (11,),
    }
    assert cfg.stage_shapes(2, 3, 5)["head_outputs"] == (2, 3, 3, 7)


def test_config_is_frozen_and_forbids_unknown_fields():
    cfg = MHAConfig(d_model=8, num_heads=2)
    with pytest.raises(pydantic.ValidationError):
        cfg.d_model = 4  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="n_heads"):
        MHAConfig(d_model=8, num_heads=2, n_heads=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(d_model=10, num_heads=3), r"head_dim: d_model=10 is not divisible by num_heads=3"),
        (dict(d_model=12, num_heads=6, num_kv_heads=4), r"num_kv_heads: num_heads=6 is not divisible by num_kv_heads=4"),
        (dict(d_model=0, num_heads=1), r"d_model"),
        (dict(d_model=8, num_heads=-2), r"num_heads"),
        (dict(d_model=8, num_heads=2, head_dim=0), r"head_dim"),
        (dict(d_model=8, num_heads=2, scale=-1.0), r"scale"),
        (dict(d_model=8, num_heads=2, causal_alignment="center"), r"causal_alignment"),
    ],
)
def test_inconsistent_configs_are_rejected_naming_the_field(fields, named):
    with pytest.raises(pydantic.ValidationError, match=named):
        MHAConfig(**fields)


def test_head_dim_given_explicitly_lifts_divisibility():
    assert MHAConfig(d_model=10, num_heads=3, head_dim=4).head_dim == 4


def test_case_spec_checks_self_attention_and_masks():
    cfg = dict(d_model=8, num_heads=2)
    with pytest.raises(pydantic.ValidationError, match="inputs: self-attention needs tgt_len == src_len"):
        CaseSpec(id="x", config=cfg, batch=1, tgt_len=2, src_len=3, inputs="self", seed=0)
    with pytest.raises(pydantic.ValidationError, match=r"mask.lengths\[1\]: 9 is outside"):
        CaseSpec(id="x", config=cfg, batch=2, tgt_len=3, src_len=3, seed=0,
                 mask={"kind": "key_padding", "lengths": [1, 9]})
    with pytest.raises(pydantic.ValidationError, match="id"):
        CaseSpec(id="Bad Name", config=cfg, batch=1, tgt_len=1, src_len=1, seed=0)


def test_duplicate_case_name_is_an_error():
    spec = CATALOG["self_basic"]
    with pytest.raises(ValueError, match="duplicate case name 'self_basic'"):
        Catalog([spec, spec])


def test_catalog_covers_the_required_features():
    specs = list(CATALOG)
    cfgs = [s.config for s in specs]
    assert any(s.inputs == "self" and s.mask is None and not s.config.causal for s in specs)
    assert any(not c.bias for c in cfgs)
    assert any(c.H == 1 for c in cfgs)
    assert any(c.D_k == 1 for c in cfgs)
    assert any(s.tgt_len != s.src_len and len({s.config.d_model, s.config.kdim, s.config.vdim}) == 3
               and s.inputs == "distinct" for s in specs)
    assert any(c.D_k != c.d_model // c.H and c.D_v != c.D_k and c.d_out != c.d_model for c in cfgs)
    assert any(s.config.causal and s.tgt_len == s.src_len for s in specs)
    for align in ("top_left", "bottom_right"):
        assert any(s.config.causal and s.config.causal_alignment == align and s.tgt_len != s.src_len for s in specs)
    assert any(s.mask is not None and s.mask.kind == "key_padding" for s in specs)
    assert any(s.mask is not None and s.mask.kind == "random" and s.mask.fully_masked for s in specs)
    assert any(c.H == 8 and c.H_kv == 2 for c in cfgs)
    assert any(c.H_kv == 1 and c.H > 1 for c in cfgs)
    assert any(c.scale != 1 / math.sqrt(c.D_k) for c in cfgs)
    assert any(s.batch == 1 for s in specs) and any(s.tgt_len == s.src_len == 1 for s in specs)
    assert any(s.tgt_len == s.src_len >= 128 for s in specs)
    # issue 11: the gaps third-party layers fell into
    assert any(s.inputs == "self" and 1 < c.H_kv < c.H for s, c in zip(specs, cfgs))  # self-attention GQA
    assert any(s.inputs == "self" and c.H_kv == 1 < c.H for s, c in zip(specs, cfgs))  # self-attention MQA
    assert any(s.inputs == "shared_kv" and s.tgt_len != s.src_len for s in specs)  # key = value memory
    assert any(s.inputs == "distinct" and s.tgt_len == s.src_len and c.kdim == c.vdim == c.d_model
               for s, c in zip(specs, cfgs))
    assert any(c.D_k != c.d_model // c.H and (c.H * c.D_k) % c.d_model == 0 and c.d_model % c.H == 0 for c in cfgs)
    assert any(s.inputs == "self" and s.mask is not None and s.mask.fully_masked and c.D_k == 8
               for s, c in zip(specs, cfgs))
    assert any(s.tgt_len > 64 and s.tgt_len % 64 and s.src_len > 128 and s.src_len % 128 for s in specs)


def test_shared_kv_inputs_pass_one_memory_tensor():
    spec = CATALOG["cross_shared_kv"]
    inputs = spec.make_inputs()
    assert inputs["key"] is inputs["value"] and not np.array_equal(inputs["query"][:, :1], inputs["key"][:, :1])
    case = spec.case("float32")
    assert case.key_is_value and not case.self_attention and case.inputs.key is case.inputs.value
    assert CATALOG["self_basic"].case().key_is_value and not CATALOG["cross_attention"].case().key_is_value
    with pytest.raises(pydantic.ValidationError, match="shared_kv .* needs kdim == vdim"):
        CaseSpec(id="x", config=MHAConfig(d_model=4, num_heads=2, kdim=3, vdim=5), batch=1, tgt_len=2, src_len=3,
                 inputs="shared_kv", seed=1)


def test_catalog_values_are_exact_in_float16_and_bfloat16():
    for spec in CATALOG:
        tensors = {**spec.make_inputs(), **spec.make_weights()}
        for name, x in tensors.items():
            if x.dtype == bool:
                continue
            for dt in (np.float16, ml_dtypes.bfloat16):
                assert np.array_equal(x.astype(dt).astype(np.float64), x), f"{spec.id}.{name} not exact in {dt}"


def test_large_logits_case_has_scores_in_the_hundreds():
    from mhaspec.reference import forward

    spec = CATALOG["large_logits"]
    s = forward(spec.config, spec.make_inputs(), spec.make_weights())["scores"]
    assert 100 < np.abs(s).max() < 1000


def test_values_come_from_shake256_not_numpy_streams():
    # Derived independently: the first 4 bytes of SHAKE-256("7/w_q") as a little-endian
    # uint32, mod 129, minus 64, times 2^-5.
    word = int.from_bytes(hashlib.shake_256(b"7/w_q").digest(4), "little")
    expected = ((word % 129) - 64) / 32
    assert dyadic_tensor("7/w_q", (1,), 5)[0] == expected


def test_catalog_file_errors_name_file_and_field(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"id": "a",}]')
    with pytest.raises(SpecError, match=r"bad.json: invalid JSON at line 1"):
        load_catalog_file(bad_json)
    bad_field = tmp_path / "field.json"
    bad_field.write_text(json.dumps([{"id": "a", "config": {"d_model": 10, "num_heads": 3},
                                      "batch": 1, "tgt_len": 2, "src_len": 2, "seed": 1}]))
    with pytest.raises(SpecError, match=r"field.json: case 0 \(a\) is invalid: cases.0.config: .*d_model=10 is not divisible"):
        load_catalog_file(bad_field)
    with pytest.raises(SpecError, match="not found"):
        load_catalog_file(tmp_path / "missing.json")


def test_shared_kv_survives_the_worker_message():
    from mhaspec.protocol.wire import case_from_message, case_message

    case = CATALOG["cross_shared_kv"].case("float16")
    again = case_from_message(*case_message(case))
    assert again.key_is_value and not again.self_attention and again.inputs.key is again.inputs.value
    assert np.array_equal(again.inputs.key, case.inputs.key)


def test_every_kind_of_inputs_declares_the_tensors_it_passes_and_their_gradients():
    import typing

    from mhaspec.spec import INPUT_GRADIENT_STAGES, INPUT_GRADIENTS, PASSED_AS, REGISTRY, gradient_of
    from mhaspec.spec.backward import FOLDED_IN_SELF_ATTENTION

    kinds = typing.get_args(CaseSpec.model_fields["inputs"].annotation)
    assert set(PASSED_AS) == set(kinds) == set(INPUT_GRADIENTS)
    for kind, tensors in PASSED_AS.items():
        passed = [name for names in tensors for name in names]
        assert sorted(passed) == ["key", "query", "value"], kind  # each input passed exactly once
        # one gradient per tensor, named after the first input it is passed as, summing every input's projection
        assert list(INPUT_GRADIENTS[kind].values()) == ["".join(n[0] for n in names) for names in tensors]
        assert [REGISTRY[g].gradient_of for g in INPUT_GRADIENTS[kind]] == [names[0] for names in tensors]
    assert INPUT_GRADIENTS["distinct"] == {gradient_of(x): x[0] for x in ("query", "key", "value")}
    assert INPUT_GRADIENTS["self"] == {gradient_of("query"): "qkv"}
    assert FOLDED_IN_SELF_ATTENTION == tuple(g for g in INPUT_GRADIENT_STAGES if g != gradient_of("query"))
