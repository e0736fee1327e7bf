"""The TensorFlow/Keras adapters: converters, masks, supports() and conformance.

Sizes are all different (3, 5, 7, 11, 13, 17, 19, 23) so an axis mix-up
changes a shape; the layout tests use arange weights checked by hand.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mhaspec.spec import CATALOG, Case, MHAConfig
from tests.conftest import require
from tests.frameworks.helpers import (assert_matches_reference, backward_shapes, check_here, variant_spec,
                                      variant_specs)

pytestmark = pytest.mark.tensorflow

tf = require("tensorflow")
keras = require("keras")

from mhaspec.adapters import keras_dpa, keras_mha, parse_deviations, tf_ops  # noqa: E402  (needs the frameworks)
from mhaspec.adapters.backends import tensorflow as tf_backend  # noqa: E402
from mhaspec.adapters.backends.tensorflow import _native_stderr_silenced  # noqa: E402


def dyadic(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Values k/64, exactly representable in every dtype under test."""
    return rng.integers(-64, 65, size=shape) / 64.0


def weights_for(config: MHAConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: dyadic(rng, *shape) for name, shape in config.weight_shapes().items()}


def make_case(config: MHAConfig, B: int, T: int, S: int, mask=None, dtype="float32", seed=0, weights=None) -> Case:
    rng = np.random.default_rng(seed + 1)
    inputs = {"query": dyadic(rng, B, T, config.d_model), "key": dyadic(rng, B, S, config.kdim),
              "value": dyadic(rng, B, S, config.vdim), "mask": mask}
    return Case.from_arrays("made_up", config, dtype, inputs, weights or weights_for(config, seed))


def variant(config: MHAConfig, **changes) -> MHAConfig:
    """``config`` with ``changes``, validated again."""
    return MHAConfig(**{**config.model_dump(), **changes})


# sizes that all differ: d_model 13, kdim 19, vdim 23, H 3, D_k 5, D_v 7, d_out 17 (MHA); H 6, H_kv 2 (GQA)
MHA_CONFIG = MHAConfig(d_model=13, num_heads=3, kdim=19, vdim=23, head_dim=5, value_head_dim=7, out_dim=17)
GQA_CONFIG = MHAConfig(d_model=13, num_heads=6, num_kv_heads=2, kdim=19, vdim=23, head_dim=5)


# -- converters ------------------------------------------------------------
@pytest.mark.parametrize("config", [MHA_CONFIG, GQA_CONFIG, variant(MHA_CONFIG, bias=False)],
                         ids=["mha", "gqa", "no_bias"])
def test_keras_converters_round_trip(config):
    weights = weights_for(config, seed=3)
    params = keras_mha.canonical_to_keras(weights, config)
    back = keras_mha.keras_to_canonical(params, config)
    assert back.keys() == weights.keys()
    for name in weights:
        np.testing.assert_array_equal(back[name], weights[name], err_msg=name)

    layer = keras_mha.make_layer(config, "float64")  # through a real layer's variables
    keras_mha.set_layer_weights(layer, weights, config)
    from_layer = keras_mha.get_layer_weights(layer, config)
    for name in weights:
        np.testing.assert_array_equal(from_layer[name], weights[name], err_msg=name)


def test_keras_layer_kind_and_variable_shapes():
    mha, gqa = keras_mha.make_layer(MHA_CONFIG), keras_mha.make_layer(GQA_CONFIG)
    assert isinstance(mha, keras.layers.MultiHeadAttention)
    assert isinstance(gqa, keras.layers.GroupQueryAttention)
    shapes = {"/".join(v.path.split("/")[-2:]): tuple(v.shape) for v in mha.weights}
    assert shapes == {
        "query/kernel": (13, 3, 5), "query/bias": (3, 5),
        "key/kernel": (19, 3, 5), "key/bias": (3, 5),
        "value/kernel": (23, 3, 7), "value/bias": (3, 7),
        "attention_output/kernel": (3, 7, 17), "attention_output/bias": (17,),
    }
    shapes = {"/".join(v.path.split("/")[-2:]): tuple(v.shape) for v in gqa.weights}
    assert shapes["key/kernel"] == (19, 2, 5) and shapes["value/kernel"] == (23, 2, 5)
    assert shapes["attention_output/kernel"] == (6, 5, 13)


def test_keras_converter_layout_by_hand():
    # d_model 2, H 2, D_k 3, D_v 1, d_out 1: w_q = [[0..5], [6..11]], head h owns columns 3h..3h+2
    config = MHAConfig(d_model=2, num_heads=2, head_dim=3, value_head_dim=1, out_dim=1, bias=False)
    weights = {name: np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
               for name, shape in config.weight_shapes().items()}
    params = keras_mha.canonical_to_keras(weights, config)
    q = params["query/kernel"]  # (d_model, H, D_k)
    assert q[0].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert q[1].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert params["attention_output/kernel"].tolist() == [[[0]], [[1]]]  # (H, D_v, d_out): w_o row h·D_v + e

    layer = keras_mha.make_layer(config, "float64")
    keras_mha.set_layer_weights(layer, weights, config)
    x = tf.constant([[[0.0, 1.0]]], tf.float64)  # (B=1, T=1, d_model=2): picks row 1 of w_q
    assert layer.query_dense(x).numpy().tolist() == [[[[6, 7, 8], [9, 10, 11]]]]


def test_keras_converters_reject_wrong_shapes():
    weights = weights_for(MHA_CONFIG)
    weights["w_q"] = weights["w_q"].T
    with pytest.raises(ValueError, match=r"weights\.w_q: expected shape \(13, 15\)"):
        keras_mha.canonical_to_keras(weights, MHA_CONFIG)
    with pytest.raises(ValueError, match="expected"):
        keras_mha.keras_to_canonical({"query/kernel": np.zeros((13, 3, 5))}, MHA_CONFIG)


def test_tf_module_converters_round_trip():
    weights = weights_for(GQA_CONFIG, seed=5)
    module = tf_ops.TFMultiHeadAttention(GQA_CONFIG, "float64")
    tf_ops.load_canonical(module, weights)
    back = tf_ops.canonical_weights(module)
    for name in weights:
        np.testing.assert_array_equal(back[name], weights[name], err_msg=name)
    with pytest.raises(ValueError, match="expected"):
        tf_ops.load_canonical(module, {k: v for k, v in weights.items() if k != "b_o"})


# -- masks -----------------------------------------------------------------
def test_mask_polarity_is_kept():
    B, T, S = 3, 5, 7
    mask = np.random.default_rng(7).random((B, 1, T, S)) < 0.5
    attention_mask, causal = keras_mha.keras_masks(make_case(MHA_CONFIG, B, T, S, mask=mask))
    assert causal is False
    np.testing.assert_array_equal(attention_mask.numpy(), mask[:, 0])  # (B, T, S), True = attend


def test_causal_masks():
    B, T, S = 2, 3, 5
    top_left = variant(MHA_CONFIG, causal=True)
    attention_mask, causal = keras_mha.keras_masks(make_case(top_left, B, T, S))
    assert attention_mask is None and causal is True  # use_causal_mask (top-left, j <= i)

    bottom_right = variant(MHA_CONFIG, causal=True, causal_alignment="bottom_right")
    padding = np.array([True, True, True, True, False])[None, None, None, :].repeat(B, 0)  # (B, 1, 1, S)
    attention_mask, causal = keras_mha.keras_masks(make_case(bottom_right, B, T, S, mask=padding))
    assert causal is False  # given as a band: j <= i + S - T, ANDed with the padding
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert attention_mask.numpy()[1].astype(int).tolist() == expected


@pytest.mark.parametrize("adapter", [keras_mha.KerasMHAScoresAdapter(), tf_ops.TensorFlowMHAAdapter()],
                         ids=["keras-scores", "tensorflow"])
def test_masked_weights_are_zero(adapter):
    B, T, S = 2, 3, 5
    mask = np.ones((B, 1, T, S), dtype=bool)
    mask[0, 0, 1, 3:] = False
    mask[1, 0, 2, :] = False  # a row that sees no key
    p = adapter.run(make_case(MHA_CONFIG, B, T, S, mask=mask))["attn_weights"]  # (B, H, T, S)
    assert p.shape == (B, 3, T, S)
    assert np.all(p[0, :, 1, 3:] == 0) and np.all(p[0, :, 1, :3] > 0)
    assert np.all(p[1, :, 2, :] == 0)
    np.testing.assert_allclose(p[0, :, 0].sum(-1), 1.0, rtol=1e-6)


def test_fused_path_fully_masked_row_is_uniform_as_declared():
    """The declared keras deviation: the fused path gives W_o·mean(V) + b_o for a row that sees no key."""
    B, T, S = 1, 2, 3
    mask = np.ones((B, 1, T, S), dtype=bool)
    mask[0, 0, 1, :] = False
    case = make_case(MHA_CONFIG, B, T, S, mask=mask, dtype="float64")
    fused = keras_mha.KerasMHAAdapter().run(case)["output"][0, 1]
    scores = keras_mha.KerasMHAScoresAdapter().run(case)["output"][0, 1]
    np.testing.assert_array_equal(scores, case.weights.b_o)  # the spec: output = b_o
    v = case.inputs.value[0] @ case.weights.w_v + case.weights.b_v  # (S, H·D_v)
    uniform = v.mean(axis=0) @ case.weights.w_o + case.weights.b_o
    np.testing.assert_allclose(fused, uniform, rtol=1e-12, atol=1e-12)


# -- supports() and the layer cache -------------------------------------------
@pytest.mark.parametrize("config, mask_heads, reason", [
    (variant(MHA_CONFIG, scale=0.125), 1, "no scale argument"),
    (MHA_CONFIG, 3, "per-head mask"),
    (variant(GQA_CONFIG, value_head_dim=7), 1, "one head_dim for keys and values"),
    (variant(GQA_CONFIG, out_dim=17), 1, "d_out=17"),
])
def test_supports_reasons(config, mask_heads, reason):
    B, T, S = 2, 3, 5
    mask = np.ones((B, mask_heads, T, S), dtype=bool)
    case = make_case(config, B, T, S, mask=mask)
    for adapter in (keras_mha.KerasMHAAdapter(), keras_mha.KerasMHAScoresAdapter()):
        answer = adapter.supports(case)
        assert isinstance(answer, str) and reason in answer
    assert keras_mha.KerasMHAAdapter().supports(make_case(MHA_CONFIG, B, T, S)) is True
    assert keras_mha.KerasMHAAdapter().supports(make_case(GQA_CONFIG, B, T, S)) is True


def test_cached_layer_gets_each_cases_weights():
    adapter = keras_mha.KerasMHAAdapter()
    first = make_case(MHA_CONFIG, 2, 3, 5, seed=11)
    second = make_case(MHA_CONFIG, 2, 3, 5, seed=11, weights=weights_for(MHA_CONFIG, seed=13))
    out_first = adapter.run(first)["output"]
    out_second = adapter.run(second)["output"]  # same (config, dtype): the cached layer, new weights
    assert not np.array_equal(out_first, out_second)
    np.testing.assert_array_equal(out_second, keras_mha.KerasMHAAdapter().run(second)["output"])


@pytest.mark.parametrize("dtype, numpy_name", [("float16", "float16"), ("bfloat16", "bfloat16"),
                                               ("float64", "float64")])
def test_stages_come_back_in_the_dtype(dtype, numpy_name):
    case = make_case(GQA_CONFIG, 2, 3, 5, dtype=dtype)
    for adapter in (keras_mha.KerasMHAScoresAdapter(), tf_ops.TensorFlowMHAAdapter()):
        stages = adapter.run(case)
        assert {a.dtype.name for a in stages.values()} == {numpy_name}
        assert stages["output"].shape == (2, 3, 13) and stages["k_proj"].shape == (2, 5, 10)


# -- declared deviations -----------------------------------------------------
#: Probes given by hand: what a CPU where oneDNN takes both narrow dtypes measures, and what one where
#: it takes neither measures with oneDNN on (tests/frameworks/test_backward_tensorflow.py measures this one's).
PROBES = {"accurate": tf_backend.Probe(softmax_tiny=1.65e-38, einsum_error={"float16": 1.0, "bfloat16": 1.0},
                                       matmul_toward_zero=0.5),
          "narrow": tf_backend.Probe(softmax_tiny=0.0, einsum_error={"float16": 14.8, "bfloat16": 13.5},
                                     matmul_toward_zero=1.0)}


@pytest.mark.parametrize("measured", PROBES)
@pytest.mark.parametrize("adapter", [keras_mha.KerasMHAAdapter, keras_mha.KerasMHAScoresAdapter,
                                     tf_ops.TensorFlowMHAAdapter, keras_dpa.KerasDPAAdapter])
def test_declared_deviations_are_narrow(adapter, measured, monkeypatch):
    """Each deviation names a catalog case, or is scoped to the rows that see no key, or is bounded
    by the worst-case contract on named stages (a sum accumulated in the dtype, in every case),
    whatever the probe measures."""
    for module in (tf_ops, keras_mha):
        monkeypatch.setattr(module, "probe", lambda: PROBES[measured])
    deviations = parse_deviations(adapter().known_deviations)
    assert deviations
    for dev in deviations:
        assert (dev.case in CATALOG or (dev.rows == "fully_masked" and dev.stage != "*")
                or (dev.within == "worst-case" and "*" not in dev.stage)), dev.pattern


# -- conformance (the whole catalog: tests/frameworks/test_catalog_runs.py) -------
def test_keras_still_deviates_upstream_on_rows_without_keys():
    from mhaspec.conformance import KNOWN_DEVIATION

    report = check_here("keras", dtypes=["float32"], cases=["custom_mask"])
    assert report.result("custom_mask", "float32").verdict == KNOWN_DEVIATION


def test_example_adapter_conforms():
    from mhaspec.conformance import check

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "keras_adapter.py")
    report = check(f"{path}:MyKerasMHA", dtypes=["float32", "float16"], cases=["self_basic", "key_padding"])
    assert report.ok and report.counts()["pass"] == 4, str(report)


# -- quiet import ------------------------------------------------------------
def test_native_stderr_is_silenced_only_inside(capfd):
    with _native_stderr_silenced():
        os.write(2, b"native noise\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_keras_float64_scale_deviation_does_not_hide_a_bug():
    """The float32-scale deviation is bounded (``within="float32"``): Keras with a real bug on top
    (the output bias dropped) fails in float64 on the very cases the deviation covers, where an
    unbounded declaration would have reported a known deviation."""
    import dataclasses

    from mhaspec.conformance import FAIL, KNOWN_DEVIATION, check

    class DropsOutputBias(keras_mha.KerasMHAAdapter):
        name = "keras+no_b_o"

        def run(self, case):
            stages = super().run(case)
            if case.weights.b_o is not None:
                stages["output"] = np.asarray(stages["output"], dtype=np.float64) - case.weights.b_o
            return stages

    covered = [c for c in keras_mha._SCALE_INEXACT_IN_FLOAT32 if next(s for s in CATALOG if s.id == c).config.bias]
    cases = covered[:2]
    assert cases
    honest = check_here("keras", dtypes=["float64"], cases=cases)
    assert honest.ok and {r.verdict for r in honest.results} == {KNOWN_DEVIATION}, honest.table()
    buggy = check(DropsOutputBias(), dtypes=["float64"], cases=cases)
    for r in buggy.results:
        assert r.verdict == FAIL and r.first_failing_stage == "output", (r.case, r.verdict)
        assert "beyond its declared deviation" in r.stage("output").message
    unbounded = DropsOutputBias()
    unbounded.known_deviations = [dataclasses.replace(d, within=None) for d in DropsOutputBias.known_deviations]
    hidden = check(unbounded, dtypes=["float64"], cases=cases)
    assert {r.verdict for r in hidden.results} == {KNOWN_DEVIATION}, "what the bound is for"


# -- keras-dpa and the attention variants (docs/spec.md §2a) ---------------------------------------------


def test_keras_dpa_declares_what_the_op_takes_and_its_softcap_is_refused():
    """keras-dpa computes a window (in the mask), a bias and ALiBi (its ``bias``) and RoPE (before the op).
    Not the softcap: ``attn_logits_soft_cap`` raises off JAX-on-TPU (and the TensorFlow backend's op never
    reads it); when Keras lifts that, this test says to declare it."""
    assert keras_dpa.KerasDPAAdapter.variants == {"window", "bias", "alibi", "rope"}
    q = tf.zeros((1, 2, 1, 4))
    with pytest.raises(ValueError, match="only supported for JAX on TPU"):
        keras.ops.dot_product_attention(q, q, q, attn_logits_soft_cap=50.0)


def test_keras_dpa_variants_match_the_exact_reference():
    """Every stage keras-dpa returns, on every variant case it declares: the projections and RoPE within a
    few float64 ulps; after the op (whose float64 scale is a float32 tensor: the keras.scale-in-float32
    deviation) within float32's rounding of the scale."""
    adapter = keras_dpa.KerasDPAAdapter()
    specs = variant_specs(adapter.variants)
    assert len(specs) >= 11
    for spec in specs:
        stages = adapter.run(spec.case("float64"))
        early = {k: v for k, v in stages.items() if k in ("q_proj", "k_proj", "v_proj", "q_rot", "k_rot")}
        assert_matches_reference(early, spec, rtol=4e-15)
        assert_matches_reference({k: stages[k] for k in ("head_outputs", "concat", "output")}, spec, rtol=1e-7)
    exact_scale = variant_spec("exact_scale", head_dim=4, d_model=12, window_left=1, alibi_slopes="standard")
    assert_matches_reference(adapter.run(exact_scale.case("float64")), exact_scale, rtol=4e-15)  # 1/2: no deviation


def test_keras_dpa_backward_returns_the_variants_gradients_of_the_exact_reference():
    """On every variant case keras-dpa declares (GQA, a per-batch and a shared bias, partial rotary with offsets,
    the window), in float64: every backward stage the case has but d_scores and d_attn_weights (inside the op),
    each in its canonical shape (d_bias in the bias input's, its gradient through the op's ``bias`` argument),
    within float32's rounding of the scale (keras.scale-in-float32, declared: 2^-25 relative on every logit,
    a few of them summed); with a scale that is a float32 number (D_k = 4), within a few dozen float64
    roundings."""
    adapter = keras_dpa.KerasDPAAdapter()
    specs = variant_specs(adapter.variants)
    inside = ("d_attn_weights", "d_scores")
    for spec in specs:
        grads = adapter.backward(spec.case("float64"))
        assert {k: v.shape for k, v in grads.items()} == backward_shapes(spec, inside), spec.id
        assert_matches_reference(grads, spec, rtol=2e-7)
    assert {"d_bias", "d_q_rot", "d_k_rot"} <= {stage for spec in specs for stage in backward_shapes(spec)}
    from mhaspec.spec.variants import BiasSpec, RopeSpec

    exact_scale = variant_spec("exact_scale", head_dim=4, d_model=12, window_left=1, alibi_slopes="standard",
                               rope=RopeSpec(rotary_dim=2, key_offset=3), bias=BiasSpec(per_batch=True))
    assert_matches_reference(adapter.backward(exact_scale.case("float64")), exact_scale, rtol=1e-13)


def test_keras_dpa_uniform_rows_do_not_reach_the_variants_gradients():
    """Rows that see no key attend uniformly in the op (declared: keras.fully-masked-backward, through P to d_v_proj
    and d_w_o), but its mask is a ``tf.where``, which passes no gradient to a masked logit: d_bias is exactly 0 on
    those rows, and d_bias, d_q_rot, d_k_rot stay within the float32 scale's rounding of the reference."""
    from mhaspec.spec.variants import BiasSpec, RopeSpec

    spec = variant_spec("empty_rows", causal_alignment="bottom_right", window_left=1, window_right=0, tgt_len=6,
                        src_len=4, bias=BiasSpec(per_batch=True), rope=RopeSpec(rotary_dim=4))
    seen = spec.case("float64").visible.any(axis=-1)  # (B, H, T)
    assert not seen.all()
    grads = keras_dpa.KerasDPAAdapter().backward(spec.case("float64"))
    assert (grads["d_bias"][~seen] == 0).all()
    assert_matches_reference({k: grads[k] for k in ("d_bias", "d_q_rot", "d_k_rot")}, spec, rtol=2e-7)
    with pytest.raises(AssertionError, match="d_v_proj"):  # the declared deviation is there, where it is declared
        assert_matches_reference({"d_v_proj": grads["d_v_proj"]}, spec, rtol=2e-7)


def test_keras_dpa_window_and_bottom_right_go_into_the_mask():
    case = variant_spec("w", causal=True, causal_alignment="bottom_right", window_left=1, tgt_len=4,
                        src_len=6).case("float32")
    mask, is_causal = keras_dpa.dpa_mask(case)
    assert not is_causal
    np.testing.assert_array_equal(mask.numpy()[:, 0], case.visible[:, 0])
    top_left = variant_spec("w", causal=True, window_left=1).case("float32")
    mask, is_causal = keras_dpa.dpa_mask(top_left)  # the op's is_causal, the window in the mask
    assert is_causal
    np.testing.assert_array_equal(mask.numpy()[0, 0] & np.tri(5, 7, dtype=bool), top_left.visible[0, 0])


def test_keras_dpa_refuses_mqa_with_the_reason():
    reason = keras_dpa.KerasDPAAdapter().supports(variant_spec("mqa", num_kv_heads=1).case("float32"))
    assert isinstance(reason, str) and "num_kv_heads > 1" in reason
    assert keras_dpa.KerasDPAAdapter().supports(variant_spec("gqa").case("float32")) is True
