"""The numpy adapter computes every attention variant (docs/spec.md §2a): in float64 it agrees with
the exact reference within a few float64 ulps of each stage's magnitude, feature by feature and in
the models' combinations (tests/variant_cases.py); in the other dtypes it returns every stage in the
dtype, near the float64 result.  (The judge's verdicts on it: tests/test_variant_proofs.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.adapters.backends import numpy as backend
from mhaspec.spec.stages import forward_stages
from mhaspec.spec.variants import VARIANTS

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


def test_the_backward_of_a_variant_case_is_refused_by_name():
    spec = spec_of("softcap")
    with pytest.raises(NotImplementedError, match="case softcap: .*config.softcap"):
        NumpyMHA().backward(spec.case("float64"))


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
