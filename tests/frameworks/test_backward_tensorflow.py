"""Backward of the TensorFlow/Keras adapters: what the tape gives, and injected backward bugs
rejected at the right first backward stage in every dtype (conformance on a few cases is in
test_backward_frameworks.py; the whole catalog is `mhaspec run ADAPTER --backward` in tox)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import golden_case

pytestmark = pytest.mark.tensorflow

tf = require("tensorflow")
require("keras")

import mhaspec  # noqa: E402
from mhaspec.adapters import keras_mha, tf_ops  # noqa: E402
from mhaspec.conformance import FAIL, PASS  # noqa: E402

DTYPES = ["float64", "float32", "float16", "bfloat16"]


class TransposedQueryKernelGradient(keras_mha.KerasMHAAdapter):
    """A wrong converter for one weight gradient: the query kernel's gradient (d_model, H, D) read as
    (d_model, D, H) — heads and head size swapped — before flattening to w_q's (d_model, H·D)."""

    name = "keras-wrong-grad-converter"

    def backward(self, case):
        right = keras_mha.keras_to_canonical

        def wrong(params, config):
            out = right(params, config)
            kernel = np.asarray(params["query/kernel"])
            out["w_q"] = kernel.transpose(0, 2, 1).reshape(kernel.shape[0], -1)
            return out

        keras_mha.keras_to_canonical = wrong  # in the worker process, for this call only
        try:
            return super().backward(case)
        finally:
            keras_mha.keras_to_canonical = right


class LeakyMaskedSoftmax(keras_mha.KerasMHAScoresAdapter):
    """Gradient leaking through masked positions: the values of the layer's masked softmax, the
    gradient of ``free``, the softmax that ignores the mask (``stop_gradient(masked) + free −
    stop_gradient(free)``): a backward that recomputes P without the mask."""

    name = "keras-scores-leaky-mask"

    def backward(self, case):
        right = keras_mha.make_layer

        def leaky_layer(config, dtype):
            layer = right(config, dtype)
            softmax = layer._masked_softmax

            def leaky(scores, attention_mask=None):
                free = softmax(scores, None)
                return tf.stop_gradient(softmax(scores, attention_mask)) + (free - tf.stop_gradient(free))

            layer._masked_softmax = leaky
            return layer

        keras_mha.make_layer = leaky_layer
        try:
            return super().backward(case)
        finally:
            keras_mha.make_layer = right


#: Cases whose scale 1/sqrt(D_k) is a float32 number (D_k = 4), so that no float64 deviation of Keras
#: (the scale rounded to float32, declared for every stage it reaches) covers the stage a bug shows in.
EXACT_SCALE = ["self_basic", "gqa", "causal_top_left"]


def test_wrong_weight_gradient_converter_fails_first_at_d_w_q_in_every_dtype() -> None:
    cases = [*EXACT_SCALE, "head_dim_1"]
    report = mhaspec.check(TransposedQueryKernelGradient(), dtypes=DTYPES, cases=cases, backward=True)
    for r in report.results:
        cfg = golden_case(r.case).config
        if cfg.H > 1 and cfg.D_k > 1:
            assert r.verdict == FAIL and r.first_failing_stage == "d_w_q", (r.case, r.dtype, r.first_failing_stage)
            assert all(st.verdict != FAIL for st in r.stages if st.stage != "d_w_q"), (r.case, r.dtype)
        else:  # head size 1: the swap is the identity, and the converter is right there
            assert r.verdict == PASS, (r.case, r.dtype, r.first_failing_stage)


def test_gradient_leaking_through_masked_positions_fails_first_at_d_scores_in_every_dtype() -> None:
    masked = ["causal_top_left", "causal_bottom_right", "causal_and_mask"]  # D_k = 4: see EXACT_SCALE
    report = mhaspec.check(LeakyMaskedSoftmax(), dtypes=DTYPES, cases=[*masked, "self_basic"], backward=True)
    for r in report.results:
        if r.case in masked:
            assert r.verdict == FAIL and r.first_failing_stage == "d_scores", (r.case, r.dtype, r.first_failing_stage)
        else:  # nothing masked: nothing leaks
            assert r.verdict == PASS, (r.case, r.dtype, r.first_failing_stage)


@pytest.mark.parametrize("name", ["tensorflow", "keras", "keras-scores"])
def test_self_attention_reports_one_input_gradient_the_sum_of_three(name: str) -> None:
    adapter = mhaspec.adapters.load_adapter(name)
    case = golden_case("self_basic", "float64")
    grads = adapter.backward(case)
    assert "d_query" in grads and "d_key" not in grads and "d_value" not in grads
    w = case.weights
    want = grads["d_q_proj"] @ w.w_q.T + grads["d_k_proj"] @ w.w_k.T + grads["d_v_proj"] @ w.w_v.T
    np.testing.assert_allclose(grads["d_query"], want, rtol=1e-12, atol=1e-12)
    shared = adapter.backward(golden_case("cross_shared_kv", "float64"))
    assert "d_key" in shared and "d_value" not in shared


def test_keras_weight_gradients_come_back_in_the_canonical_layout() -> None:
    """The Keras kernels are (d_model, H, D) …; their gradients go through keras_to_canonical:
    d_w_q is queryᵀ @ d_q_proj summed over batch and length, in w_q's (d_model, H·D) layout."""
    case = golden_case("cross_attention", "float64")
    grads = keras_mha.KerasMHAScoresAdapter().backward(case)
    for name, shape in case.config.weight_shapes().items():
        assert grads[f"d_{name}"].shape == shape, name
    q = case.inputs.query.reshape(-1, case.config.d_model)
    np.testing.assert_allclose(grads["d_w_q"], q.T @ grads["d_q_proj"].reshape(q.shape[0], -1), rtol=1e-12)
    np.testing.assert_allclose(grads["d_b_o"], case.d_output.sum(axis=(0, 1)), rtol=1e-12)


def test_tensorflow_float16_bias_gradient_is_a_float16_sum() -> None:
    """The cause of the declared key_padding/float16/d_b_q deviation: TensorFlow's CPU Sum of float16
    differs from the float32 sum rounded once (bfloat16, which has a float accumulator, does not)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((21, 12)) * 3
    half = tf.reduce_sum(tf.constant(x.astype(np.float16)), axis=0).numpy()
    assert not np.array_equal(half, x.astype(np.float16).astype(np.float32).sum(0).astype(np.float16))
    declared = [d for d in tf_ops.TensorFlowMHAAdapter.known_deviations if d.matches("key_padding", "float16", "d_b_q")]
    assert [d.within for d in declared] == ["worst-case"]  # a float16 sum: within the worst-case contract
