"""The numpy adapter computes every attention variant (docs/spec.md §2a), forward and backward: in float64
it agrees with the exact reference within a few float64 ulps of each stage's magnitude, feature by feature
and in the models' combinations (tests/variant_cases.py), and its gradients are the loss's directional
derivatives; in the other dtypes it returns every stage in the dtype, near the exact result.  (The judge's
verdicts on it: tests/test_variant_proofs.py.)"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.adapters.backends import numpy as backend
from mhaspec.spec.backward import backward_stage_shapes
from mhaspec.spec.stages import compared_entries, forward_stages
from mhaspec.spec.variants import VARIANTS

from .test_variant_backward_reference import exact_stages
from .variant_cases import CASES, exact, spec_of

U = 2.0**-53
#: unit roundoff of each dtype
UNIT = {"float64": U, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def error_in_units(got: np.ndarray, want: np.ndarray, unit: float) -> float:
    """max |got − want| over the finite golden entries, in units of ``unit`` × the stage's largest
    magnitude; the non-finite entries (an empty row's −inf lse) must be equal."""
    got = np.asarray(got, dtype=np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), "non-finite entries differ"
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-300)
    return float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)) / (unit * scale)


def test_the_numpy_adapter_declares_every_variant():
    assert NumpyMHA.variants == frozenset(VARIANTS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_agrees_with_the_exact_reference_within_a_few_ulps(name):
    spec = spec_of(name)
    got = NumpyMHA().run(spec.case("float64"))
    want = exact(name)
    assert set(got) == set(want) == set(forward_stages(spec.config)), "every stage, q_rot/k_rot with rope, lse"
    for stage in want:
        assert got[stage].shape == want[stage].shape, stage
        # measured: at most 4.5 ulps of the stage's magnitude (q_rot, scores, lse, outputs); 8 leaves room
        assert error_in_units(got[stage], want[stage], U) <= 8, stage


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["everything", "gpt_oss", "llama3_partial", "softcap_large_logits",
                                  "sinks_masked_rows"])
def test_every_stage_comes_in_the_dtype_near_the_float64_result(name, dtype):
    got = NumpyMHA().run(spec_of(name).case(dtype))
    want = exact(name)
    for stage, value in got.items():
        assert value.dtype == backend.dtype(dtype), stage
        # measured: at most 6.5 units of the dtype × the stage's magnitude; 32 is a sanity bound, the
        # judge's tolerances are the real check (tests/test_variant_proofs.py)
        assert error_in_units(value, want[stage], UNIT[dtype]) <= 32, stage


def test_a_row_that_sees_no_key_has_zero_weights_and_lse_minus_inf_with_a_sink():
    spec = spec_of("sinks_masked_rows")
    got = NumpyMHA().run(spec.case("float32"))
    empty = ~spec.case("float32").visible.any(axis=-1)  # (B, H, T)
    assert empty.any()
    assert np.all(got["attn_weights"][empty] == 0) and np.all(got["lse"][empty] == -np.inf)
    assert np.all(got["attn_weights"].sum(axis=-1)[~empty] < 1)  # the sink's share


@functools.cache
def exact_gradients(name: str) -> dict[str, np.ndarray]:
    """Every backward stage of case ``name`` by the exact float64 reference."""
    return exact_stages(spec_of(name))[1]


def _loss(case) -> float:
    """L = Σ d_output ⊙ output of the numpy adapter's forward (float64), the loss every gradient is of."""
    return float(np.sum(case.d_output * NumpyMHA().run(case)["output"]))


def _nudged(case, where: str, step: np.ndarray):
    """``case`` with ``step`` added to ``where``: the query tensor (every input that is that tensor: all three
    in self-attention), the bias input, or the sink logits."""
    if where == "sink_logits":
        return case.model_copy(update={"weights": case.weights.model_copy(
            update={"sink_logits": case.weights.sink_logits + step})})
    names = {"bias": ("bias",), "query": ("query", "key", "value") if case.self_attention else ("query",)}[where]
    update = {name: getattr(case.inputs, name) + step for name in names}
    return case.model_copy(update={"inputs": case.inputs.model_copy(update=update)})


#: each variant gradient and the leaf it is checked through: d_query covers d_q_rot, d_k_rot (RoPE turned back)
#: and the softcap′ on its way (no other way to perturb an intermediate stage)
DIRECTIONS = {"d_query": "query", "d_bias": "bias", "d_sink_logits": "sink_logits"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_gradients_are_the_loss_s_directional_derivatives(name):
    """⟨gradient, v⟩ = (L(x + εv) − L(x − εv)) / 2ε along a random v: a central difference is off by
    ε²/6·|L‴| + u·|L|/ε (ε = 1e-5): measured at most 1e-9 of ⟨|g|, |v|⟩ ("sinks", d_sink_logits; in
    "window_zero" every row sees one key and d_query is 0, the difference too); 1e-7 leaves room, and a variant
    left out of the backward (softcap′ 1 − tanh², RoPE's turn back, the sink's −p·δ, a bias summed over
    the wrong axes) moves it by percents."""
    case = spec_of(name).case("float64")
    got = NumpyMHA().backward(case)
    rng = np.random.default_rng(7)
    checked = [stage for stage in DIRECTIONS if stage in got]
    for stage in checked:
        v = rng.standard_normal(got[stage].shape)
        eps = 1e-5
        numeric = (_loss(_nudged(case, DIRECTIONS[stage], eps * v))
                   - _loss(_nudged(case, DIRECTIONS[stage], -eps * v))) / (2 * eps)
        analytic = float(np.sum(got[stage] * v))
        assert abs(numeric - analytic) <= 1e-7 * float(np.sum(np.abs(got[stage] * v))), (stage, numeric, analytic)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_backward_agrees_with_the_exact_reference_within_a_few_ulps(name):
    """Every backward stage (the variants' too) against :func:`mhaspec.reference.backward`: measured at most
    10.7 ulps of the stage's magnitude (d_sink_logits of "everything"); 32 leaves room.  d_b_k is exactly 0
    without a sink (each row of d_scores sums to 0): it is measured against the magnitude of what it sums,
    Σ_rows |d_k_proj| (measured: 2.6 ulps of that)."""
    spec = spec_of(name)
    case = spec.case("float64")
    got = NumpyMHA().backward(case)
    want = exact_gradients(name)
    assert set(got) == set(want)
    visible = case.visible
    for stage, value in got.items():
        entries = compared_entries(stage, visible)
        g, w = (x if entries is None else x[entries] for x in (value, want[stage]))
        if stage == "d_b_k":
            terms = float(np.abs(want["d_k_proj"]).sum(axis=(0, 1)).max())
            assert float(np.abs(g - w).max()) <= 32 * U * terms, stage
        else:
            assert error_in_units(g, w, U) <= 32, stage


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_backward_returns_every_stage_the_case_has_in_its_shape_and_dtype(name, dtype):
    spec = spec_of(name)
    case = spec.case(dtype)
    bias_shape = None if case.inputs.bias is None else case.inputs.bias.shape
    want = backward_stage_shapes(case.config, case.B, case.T, case.S, spec.inputs, bias_shape)
    got = NumpyMHA().backward(case)
    assert set(got) == set(want), "every backward stage has_stage() gives the case, the variants' too"
    for stage, shape in want.items():
        assert got[stage].shape == shape and got[stage].dtype == backend.dtype(dtype), stage
    if dtype == "float64":
        return
    exact_grads = exact_gradients(name)
    visible = case.visible
    for stage, value in got.items():
        entries = compared_entries(stage, visible)
        g, w = (x if entries is None else x[entries] for x in (value, exact_grads[stage]))
        # measured: at most 9.4 units of the dtype × the stage's magnitude, d_b_k aside (exactly 0 without a
        # sink: rows of d_scores sum to 0, so it is rounding noise); 64 is a sanity bound, the judge's
        # tolerances are the real check
        if stage != "d_b_k":
            assert error_in_units(g, w, UNIT[dtype]) <= 64, stage


def test_a_row_that_sees_no_key_has_zero_score_gradients_and_a_finite_sink_gradient():
    """p_sink = e^(sink − lse) with lse = −inf would be inf, and inf·0 NaN: such a row adds nothing."""
    case = spec_of("sinks_masked_rows").case("float64")
    got = NumpyMHA().backward(case)
    empty = ~case.visible.any(axis=-1)  # (B, H, T)
    assert empty.any()
    assert np.all(got["d_scores"][empty] == 0)
    assert np.all(np.isfinite(got["d_sink_logits"]))


def test_the_variant_stages_travel_from_a_worker():
    """An isolated adapter's q_rot, k_rot and lse reach the runner as arrays (the worker once sent only
    the spec-1.1 and backward stages, and the rest by name: judged as dtype object)."""
    from mhaspec.protocol.wire import returned_reply, unpack_returned

    returned = NumpyMHA().run(spec_of("everything").case("float32"))
    header, parts = returned_reply("run", returned, 0.0)
    payload = bytes(parts)
    back = unpack_returned(header, payload)
    assert {"q_rot", "k_rot", "lse"} <= set(back)
    for stage, value in returned.items():
        assert back[stage].dtype == value.dtype and np.array_equal(back[stage], value), stage
