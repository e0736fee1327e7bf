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


class EinsumBug(tf_ops.TensorFlowMHAAdapter):
    """The ``tensorflow`` adapter with a bug inside an einsum stage, the stages its float16 Einsum
    deviation covers where it is declared: the scores scaled by 1/√d_model instead of 1/√D_k, or
    each head reading the values of another head (heads reversed)."""

    def __init__(self, bug: str) -> None:
        self.bug, self.name = bug, f"tensorflow-{bug}"

    def _buggy(self, method, case):
        real = tf_ops.tf.einsum

        def einsum(equation, a, b):
            if self.bug == "values_of_another_head" and equation == "BHTS,BSHE->BHTE":
                b = tf.reverse(b, axis=[2])
            out = real(equation, a, b)
            if self.bug == "scale_of_d_model" and equation == "BTHD,BSHD->BHTS":
                out = out * tf.constant(np.sqrt(case.config.D_k / case.config.d_model), dtype=out.dtype)
            return out

        tf_ops.tf.einsum = einsum  # in the forked worker only
        try:
            return method(case)
        finally:
            tf_ops.tf.einsum = real

    def run(self, case):
        return self._buggy(super().run, case)

    def backward(self, case):
        return self._buggy(super().backward, case)


@pytest.mark.parametrize("bug, stage", [("scale_of_d_model", "scores"), ("values_of_another_head", "head_outputs")])
def test_a_bug_inside_the_float16_einsum_deviation_fails_in_every_dtype(bug: str, stage: str) -> None:
    """The float16 Einsum declaration (where this CPU has it) is bounded by the worst-case contract:
    a bug in a stage it covers still fails there, in float16 as in every other dtype."""
    cases = ["long_sequence", "batch_one", "gqa"]  # H = 2, 3, 4 (the heads differ, and d_model != D_k)
    report = mhaspec.check(EinsumBug(bug), dtypes=DTYPES, cases=cases, backward=True)
    for r in report.results:
        assert r.verdict == FAIL and r.first_failing_stage == stage, (r.case, r.dtype, r.first_failing_stage)
    declared = [d for d in tf_ops.TensorFlowMHAAdapter.known_deviations if d.matches("gqa", "float16", stage)]
    for r in report.results:
        if r.dtype == "float16" and declared:
            assert "beyond its declared deviation" in r.stage(stage).message, (r.case, r.stage(stage).message)


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
    """The cause of the declared float16 d_b_q deviation (key_padding, or every case with the Einsum
    one): TensorFlow's CPU Sum of float16 differs from the float32 sum rounded once (bfloat16, which
    has a float accumulator, does not)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((21, 12)) * 3
    half = tf.reduce_sum(tf.constant(x.astype(np.float16)), axis=0).numpy()
    assert not np.array_equal(half, x.astype(np.float16).astype(np.float32).sum(0).astype(np.float16))
    declared = [d for d in tf_ops.TensorFlowMHAAdapter.known_deviations if d.matches("key_padding", "float16", "d_b_q")]
    assert [d.within for d in declared] == ["worst-case"]  # a float16 sum: within the worst-case contract


#: What :func:`einsum_float16_error` calls a float16 accumulation: a float32 one stays near 1.
EINSUM_FLOAT16_PROBE_LIMIT = 2.0


def einsum_float16_error() -> float:
    """How far this TensorFlow's float16 ``tf.einsum`` (the ``tensorflow`` adapter's head-outputs
    product, on the default device) is from the exact product, as a multiple of the error of
    rounding that product to float16 (root mean square over 16 × 8 outputs of 512 terms each,
    fixed data): about 1 for a float32 accumulation, 10 to 20 for a float16 one."""
    rng = np.random.default_rng(0)
    p = rng.random((1, 1, 16, 512)).astype(np.float16)
    v = rng.standard_normal((1, 512, 1, 8)).astype(np.float16)
    exact = np.einsum("BHTS,BSHE->BHTE", p.astype(np.float64), v.astype(np.float64))
    got = tf.einsum("BHTS,BSHE->BHTE", tf.constant(p), tf.constant(v)).numpy().astype(np.float64)
    rounding = np.sqrt(np.mean((exact.astype(np.float16).astype(np.float64) - exact) ** 2))
    return float(np.sqrt(np.mean((got - exact) ** 2)) / rounding)


def test_tensorflow_float16_einsum_accumulates_as_the_declaration_says(monkeypatch) -> None:
    """The adapter declares the float16 Einsum deviation from TensorFlow's own rule (CPU flags and
    oneDNN's switch, read without running an op) wherever oneDNN does not take float16; where it
    does, a float16 tf.einsum must measure as a float32 accumulation, or the declaration would be
    missing.  (Where Eigen's kernel runs, how much it loses may depend on its blocking: the
    declaration, bounded by the worst-case contract, stands either way, with the Sum's.)  The
    probe tells the two accumulations apart: a float32 one (the same product by tf.linalg.matmul,
    or a tf.einsum taken in float32 and rounded once) stays near 1; on this project's AMD EPYC
    machines Eigen's float16 einsum measures about 15.

    Runs TensorFlow ops in this process: last in this file, after the adapters that are forked."""
    from mhaspec.adapters import _tf_common

    ratio = einsum_float16_error()
    why = _tf_common.onednn_float16_missing()
    if why is None:
        assert ratio <= EINSUM_FLOAT16_PROBE_LIMIT, f"oneDNN takes float16, yet the einsum measures {ratio}"
    declared = [d for d in tf_ops.TensorFlowMHAAdapter.known_deviations if d.dtype == "float16"]
    einsum = [d for d in declared if d.matches("tile_crossing", "float16", "head_outputs")]
    assert len(einsum) == (why is not None) and all(d.within == "worst-case" for d in declared), declared
    for stage in _tf_common.EINSUM_STAGES:
        assert any(d.matches("long_sequence", "float16", stage) for d in einsum) == bool(einsum), stage
    assert not any(d.matches("long_sequence", "float16", s) for d in declared for s in ("output", "d_w_q", "q_proj"))

    real = tf.einsum

    def float32_einsum(equation, a, b):
        return tf.cast(real(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32)), a.dtype)

    def matmul_einsum(equation, p, v):  # the same product by tf.linalg.matmul: (B, H, T, S) @ (B, H, S, E)
        return tf.linalg.matmul(p, tf.transpose(v, (0, 2, 1, 3)))

    for accurate in (float32_einsum, matmul_einsum):
        monkeypatch.setattr(tf, "einsum", accurate)
        assert einsum_float16_error() < 1.5, accurate.__name__
    monkeypatch.setattr(_tf_common, "onednn_float16_missing", lambda: None)
    assert [d.case for d in _tf_common.float16_sum_deviations()] == ["key_padding"]  # the Sum alone
