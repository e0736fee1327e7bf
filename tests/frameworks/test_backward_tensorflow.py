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
from mhaspec.adapters import Deviation, keras_mha, tf_ops  # noqa: E402
from mhaspec.conformance import FAIL, KNOWN_DEVIATION, PASS  # noqa: E402
from mhaspec.conformance.worker import Worker  # noqa: E402

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
        else:  # nothing masked: nothing leaks (bfloat16's d_attn_weights is the truncation declared where measured)
            assert r.verdict in (PASS, KNOWN_DEVIATION) and r.stage("d_scores").verdict == PASS, (r.case, r.dtype)


def declared_in_its_worker(adapter) -> list[Deviation]:
    """The adapter's ``known_deviations`` as its worker reads them: the TensorFlow adapters' probe runs
    there, in a forked worker, never in this process (a fork after TensorFlow ops ran here may hang)."""
    worker = Worker(adapter)
    try:
        return [Deviation(**d) for d in worker.wait_loaded()["deviations"]]
    finally:
        worker.close()


class EinsumBug(tf_ops.TensorFlowMHAAdapter):
    """The ``tensorflow`` adapter with a bug inside an einsum stage, the stages its Einsum deviations
    (float16, bfloat16) cover where the probe declares them: the scores scaled by 1/√d_model instead of 1/√D_k, or
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
def test_a_bug_inside_the_einsum_deviations_fails_in_every_dtype(bug: str, stage: str) -> None:
    """The Einsum declarations (float16, bfloat16: where this process's probe measures a sum in the
    dtype) are bounded by the worst-case contract: a bug in a stage they cover still fails there, in
    the narrow dtypes as in every other dtype."""
    cases = ["long_sequence", "batch_one", "gqa"]  # H = 2, 3, 4 (the heads differ, and d_model != D_k)
    adapter = EinsumBug(bug)
    report = mhaspec.check(adapter, dtypes=DTYPES, cases=cases, backward=True)
    for r in report.results:
        assert r.verdict == FAIL and r.first_failing_stage == stage, (r.case, r.dtype, r.first_failing_stage)
    declared = declared_in_its_worker(adapter)
    for r in report.results:
        if any(d.within == "worst-case" and d.matches(r.case, r.dtype, stage) for d in declared):
            assert "beyond its declared deviation" in r.stage(stage).message, (r.case, r.stage(stage).message)


class ValuesOfAnotherHeadInTheGradient(keras_mha.KerasMHAScoresAdapter):
    """``keras-scores`` with a backward bug at the stage its bfloat16 matmul truncation is declared
    for: the gradient of the attention weights (through the layer's combine product P·V) reads the
    values of another head (heads reversed); the forward and the values' gradient are right."""

    name = "keras-scores-grad-of-another-head"

    def backward(self, case):
        from keras.src import ops

        real = ops.einsum

        def einsum(equation, *operands, **kwargs):
            if equation != "acbe,aecd->abcd":  # the layer's _combine_equation: (B,H,T,S), (B,S,H,E)
                return real(equation, *operands, **kwargs)
            p, v = operands
            out = real(equation, tf.stop_gradient(p), v)  # the value, and the values' gradient
            wrong = real(equation, p, tf.stop_gradient(tf.reverse(v, axis=[2])))  # the weights' gradient
            return out + (wrong - tf.stop_gradient(wrong))

        ops.einsum = einsum  # in the forked worker, for this call only
        try:
            return super().backward(case)
        finally:
            ops.einsum = real


def test_a_bug_inside_the_matmul_truncation_deviation_fails_in_every_dtype() -> None:
    """keras-scores' bfloat16 d_attn_weights declaration (where the probe measures a truncating
    matmul) is bounded by the worst-case contract: a gradient that reads another head's values still
    fails first at d_attn_weights, in bfloat16 as in every other dtype."""
    adapter = ValuesOfAnotherHeadInTheGradient()
    cases = ["self_basic", "causal_top_left", "batch_one"]  # H = 3, D_k = 4 (an exact float32 scale)
    report = mhaspec.check(adapter, dtypes=DTYPES, cases=cases, backward=True)
    for r in report.results:
        assert r.verdict == FAIL and r.first_failing_stage == "d_attn_weights", (r.case, r.dtype,
                                                                                 r.first_failing_stage)
    declared = [d for d in declared_in_its_worker(adapter) if d.matches("self_basic", "bfloat16", "d_attn_weights")]
    assert all(d.within == "worst-case" for d in declared), declared
    for r in report.results:
        if r.dtype == "bfloat16" and declared:
            assert "beyond its declared deviation" in r.stage("d_attn_weights").message, r.case


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
    from mhaspec.adapters.backends import tensorflow as tf_backend

    for narrow in (0.9, 15.0):  # the float16 einsum in float32 (the Sum alone), or in float16 (one declaration)
        measured = tf_backend.Probe(softmax_tiny=1.6e-38, einsum_error={"float16": narrow, "bfloat16": 1.0},
                                    matmul_toward_zero=0.5)
        declared = [d for d in tf_backend.einsum_deviations(measured) if d.matches("key_padding", "float16", "d_b_q")]
        assert [d.within for d in declared] == ["worst-case"]  # a float16 sum: within the worst-case contract


def fake_probe(softmax_tiny=1.65e-38, float16=1.0, bfloat16=1.0, toward_zero=0.5):
    """A :class:`Probe` given by hand: the declarations are a function of it (no TensorFlow op runs)."""
    from mhaspec.adapters.backends import tensorflow as tf_backend

    return tf_backend.Probe(softmax_tiny=softmax_tiny, einsum_error={"float16": float16, "bfloat16": bfloat16},
                            matmul_toward_zero=toward_zero)


def test_the_declarations_follow_the_probe(monkeypatch) -> None:
    """Each machine-dependent declaration is made exactly where the probe measures its mechanism, on the
    stages and in the dtype it reaches, bounded, with the measured figure in its reason."""
    from mhaspec.adapters.backends import tensorflow as tf_backend

    def declared(adapter, measured):
        monkeypatch.setattr(tf_ops, "probe", lambda: measured)
        monkeypatch.setattr(keras_mha, "probe", lambda: measured)
        return adapter().known_deviations

    accurate = fake_probe()
    assert [(d.case, d.dtype, d.stage) for d in declared(tf_ops.TensorFlowMHAAdapter, accurate)] == [
        ("key_padding", "float16", "d_b_q")]  # the float16 Sum, on every machine
    assert not any(d.dtype in ("bfloat16", "float32") and d.case in ("*", "large_logits")
                   for d in declared(keras_mha.KerasMHAScoresAdapter, accurate))  # (BiasAddGrad's name cases)

    narrow = fake_probe(softmax_tiny=0.0, float16=14.8, bfloat16=13.5, toward_zero=1.0)
    tf_declared = declared(tf_ops.TensorFlowMHAAdapter, narrow)
    for dtype, figure in (("float16", "14.8x"), ("bfloat16", "13.5x")):
        einsum = [d for d in tf_declared if d.dtype == dtype]
        assert len(einsum) == 1 and einsum[0].within == "worst-case" and einsum[0].case == "*", einsum
        assert f"a {dtype} tf.einsum over 512 terms has {figure}" in einsum[0].reason
        for stage in tf_backend.EINSUM_STAGES:
            assert einsum[0].matches("long_sequence", dtype, stage), stage
        for stage in ("q_proj", "attn_weights", "output", "d_scores", "d_w_q", "d_query"):
            assert not einsum[0].matches("long_sequence", dtype, stage), stage
        assert einsum[0].matches("gqa", dtype, "d_b_q") == (dtype == "float16")  # float16's Sum beside it
    softmax = [d for d in tf_declared if d.case == "large_logits"]
    assert [(d.dtype, d.stage, d.within) for d in softmax] == [("float32", "attn_weights", None),
                                                               ("float32", "d_scores", None)]
    assert "gives 0 for exp(-87)" in softmax[0].reason

    scores = declared(keras_mha.KerasMHAScoresAdapter, narrow)
    truncation = [d for d in scores if d.dtype == "bfloat16" and d.case == "*"]
    assert [(d.stage, d.within) for d in truncation] == [("d_attn_weights", "worst-case")]
    assert "probe: 100% of a bfloat16 tf.linalg.matmul's inexact results are rounded toward zero" in truncation[0].reason
    assert [d.stage for d in scores if d.case == "large_logits" and d.dtype == "float32"] == ["attn_weights",
                                                                                             "d_scores"]
    fused = keras_mha.KerasMHAAdapter().known_deviations  # no probe: the fused path's hold everywhere
    assert not any(d.dtype in ("bfloat16", "float32") and d.case in ("*", "large_logits") for d in fused)


def test_the_probe_measures_what_it_says(monkeypatch) -> None:
    """This process's probe (``backends.tensorflow.probe()``, the one the adapters' workers make) against
    direct measurements on other data and shapes: the einsum of the catalog's tile_crossing shape
    (65 queries over 129 keys, 16 values), the bfloat16 matmul bit for bit, a softmax of another tiny
    probability.  And the probe tells the accumulations apart: a float32 accumulation rounded once
    measures 1, one rounded toward zero (bfloat16 tf.linalg.matmul) about 2, both below the limit.

    Runs TensorFlow ops in this process: last in this file, after the adapters that are forked."""
    from mhaspec.adapters.backends import tensorflow as tf_backend
    from tensorflow.python.util import _pywrap_util_port

    measured = tf_backend.probe()
    rng = np.random.default_rng(7)
    for dtype in ("float16", "bfloat16"):
        np_dtype = tf_backend.dtype(dtype).as_numpy_dtype
        p = rng.random((1, 1, 65, 129)).astype(np_dtype)
        v = rng.standard_normal((1, 129, 1, 16)).astype(np_dtype)
        exact = np.einsum("BHTS,BSHE->BHTE", p.astype(np.float64), v.astype(np.float64))
        got = tf.einsum("BHTS,BSHE->BHTE", tf.constant(p), tf.constant(v)).numpy().astype(np.float64)
        once = exact.astype(np_dtype).astype(np.float64)
        ratio = np.sqrt(np.mean((got - exact) ** 2)) / np.sqrt(np.mean((once - exact) ** 2))
        if measured.einsum_narrow(dtype):
            assert ratio > 2.0, (dtype, ratio, measured)
        else:
            assert ratio < 1.5, (dtype, ratio, measured)

    real = tf.einsum

    def float32_einsum(equation, a, b):
        return tf.cast(real(equation, tf.cast(a, tf.float32), tf.cast(b, tf.float32)), a.dtype)

    def matmul_einsum(equation, p, v):  # the same product by tf.linalg.matmul: (B, H, T, S) @ (B, H, S, E)
        return tf.linalg.matmul(p, tf.transpose(v, (0, 2, 1, 3)))

    for dtype in ("float16", "bfloat16"):
        assert tf_backend.einsum_error(dtype, float32_einsum) < 1.5, dtype
        assert tf_backend.einsum_error(dtype, matmul_einsum) < tf_backend.NARROW_ACCUMULATION_LIMIT, dtype

    a = rng.standard_normal((32, 48)).astype(tf_backend.dtype("bfloat16").as_numpy_dtype)
    b = rng.standard_normal((48, 24)).astype(tf_backend.dtype("bfloat16").as_numpy_dtype)
    got = tf.linalg.matmul(tf.constant(a), tf.constant(b)).numpy()
    f32 = tf.linalg.matmul(tf.constant(a.astype(np.float32)), tf.constant(b.astype(np.float32))).numpy()
    truncated = (f32.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert np.array_equal(got.astype(np.float32), truncated) == measured.matmul_truncates, measured
    rounded = lambda x, y: tf.cast(tf.linalg.matmul(tf.cast(x, tf.float32), tf.cast(y, tf.float32)), tf.bfloat16)
    assert 0.3 < tf_backend.matmul_toward_zero(rounded) < tf_backend.TRUNCATION_LIMIT

    tiny = tf.nn.softmax(tf.constant([[0.0, -86.9]], tf.float32)).numpy()[0, 1]  # 1.8e-38 < 2^-125
    assert (tiny == 0) == measured.softmax_flushes, (tiny, measured)
    if measured.softmax_flushes:  # Eigen's softmax returns it: only oneDNN's flushes
        assert _pywrap_util_port.IsMklEnabled()
