"""Backward of the Flax adapters (``jax.vjp``): parameter gradients back through the converters,
and injected backward bugs rejected at the right first backward stage in every dtype
(conformance on a few cases is in test_backward_frameworks.py; the whole catalog is
`mhaspec run ADAPTER --backward` in tox)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import GOLDEN, golden_case

pytestmark = pytest.mark.jax

jax = require("jax")
require("flax")

import mhaspec  # noqa: E402
from mhaspec.adapters import flax_linen, flax_nnx  # noqa: E402
from mhaspec.conformance import FAIL, PASS  # noqa: E402

DTYPES = ["float64", "float32", "float16", "bfloat16"]


class TransposedOutKernelGradient(flax_linen.FlaxLinenAdapter):
    """A wrong converter for one parameter gradient: ``out/kernel`` (H, D, d_out) read as (D, H, d_out)
    — heads and head size swapped — before flattening to w_o's (H·D, d_out)."""

    name = "flax-linen-wrong-grad-converter"

    def backward(self, case):
        right = flax_linen.linen_params_to_canonical

        def wrong(params):
            out = right(params)
            kernel = np.asarray(params["out"]["kernel"])
            out["w_o"] = kernel.transpose(1, 0, 2).reshape(-1, kernel.shape[-1])
            return out

        flax_linen.linen_params_to_canonical = wrong  # for this call only
        try:
            return super().backward(case)
        finally:
            flax_linen.linen_params_to_canonical = right


def test_wrong_parameter_gradient_converter_fails_first_at_d_w_o_in_every_dtype() -> None:
    cases = ["self_basic", "cross_attention", "causal_square", "one_head", "head_dim_1"]
    # in this process: a worker forked after JAX has started in it (any test before this one) hangs in JAX's threads
    report = mhaspec.check(TransposedOutKernelGradient(), dtypes=DTYPES, cases=cases, backward=True, isolate=False)
    for r in report.results:
        cfg = golden_case(r.case).config
        if cfg.H > 1 and cfg.D_v > 1:
            assert r.verdict == FAIL and r.first_failing_stage == "d_w_o", (r.case, r.dtype, r.first_failing_stage)
            assert all(st.verdict != FAIL for st in r.stages if st.stage != "d_w_o"), (r.case, r.dtype)
        else:  # one head, or head size 1: the swap is the identity
            assert r.verdict == PASS, (r.case, r.dtype, r.first_failing_stage)


@pytest.mark.parametrize("adapter", [flax_linen.FlaxLinenAdapter, flax_nnx.FlaxNNXAdapter])
def test_parameter_gradients_come_back_in_the_canonical_layout(adapter) -> None:
    """The Flax kernels are (d_model, H, D) …; their gradients go through the adapter's
    params -> canonical converter: d_w_q = queryᵀ @ d_q_proj, d_w_o = concatᵀ @ d_output."""
    case = golden_case("self_basic", "float64")
    grads = adapter().backward(case)
    for name, shape in case.config.weight_shapes().items():
        assert grads[f"d_{name}"].shape == shape, name

    def rows(x):
        return np.asarray(x).reshape(-1, x.shape[-1])

    np.testing.assert_allclose(grads["d_w_q"], rows(case.inputs.query).T @ rows(grads["d_q_proj"]), rtol=1e-12)
    np.testing.assert_allclose(grads["d_w_v"], rows(case.inputs.value).T @ rows(grads["d_v_proj"]), rtol=1e-12)
    np.testing.assert_allclose(grads["d_b_q"], rows(grads["d_q_proj"]).sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(grads["d_b_o"], case.d_output.sum(axis=(0, 1)), rtol=1e-12)
    if adapter is flax_linen.FlaxLinenAdapter:  # it returns concat: d_w_o = concatᵀ @ d_output
        concat = adapter().run(case)["concat"]
        np.testing.assert_allclose(grads["d_w_o"], rows(concat).T @ rows(case.d_output), rtol=1e-12)
    assert "d_key" not in grads and "d_value" not in grads  # self-attention: d_query is the sum of three


def test_nnx_gqa_key_gradient_sums_its_group() -> None:
    """With H_kv < H the tap sits on the key projection before flax repeats its heads, so d_k_proj
    comes back already summed over each group of query heads, in the canonical (B, S, H_kv·D) shape,
    equal to the golden's in float64."""
    case = golden_case("gqa", "float64")
    got = flax_nnx.FlaxNNXAdapter().backward(case)
    golden = GOLDEN.load("gqa").stages
    assert got["d_k_proj"].shape == (case.batch, case.src_len, case.config.H_kv * case.config.D_k)
    for name in ("d_k_proj", "d_v_proj", "d_w_k", "d_w_v"):
        np.testing.assert_allclose(got[name], golden[name], rtol=1e-9, atol=1e-12, err_msg=name)
