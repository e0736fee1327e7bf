"""The numpy adapter's ``decode`` (docs/serving.md) against its own ``run``: with a causal, bottom-right
case, call c of a schedule sees exactly query rows [t0, t1) of the full pass over keys [0, L_c), so each
call's query stages are those rows and columns of ``run``'s, and its cache (k_proj, k_rot, v_proj) is
``run``'s key rows [0, L_c) — equal to rounding (the sums run over fewer keys, BLAS sees fewer rows).
Sizes all different (B=2, T=5, S=7: a past of P=2 keys, H=3, D_k=6); every variant of
tests/test_variant_spec.py, made causal bottom-right."""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.adapters.numpy_mha import NumpyMHA, decode_calls
from mhaspec.spec import Case
from mhaspec.spec.schedule import schedule_calls

from .decode_zoo import call_view
from .test_variant_spec import VARIANTS, _spec

#: ulps of the stage's largest magnitude by which a call may differ from the full pass
ULPS = 64
SCHEDULES = {"one prefill": [5], "prefill then decode": [1, 1, 1, 1, 1], "chunks": [2, 1, 2]}
CAUSAL = {name: {**fields, "causal": True, "causal_alignment": "bottom_right"} for name, fields in VARIANTS.items()
          if fields.get("T", 5) <= fields.get("S", 7)}


def causal_case(name: str, dtype: str) -> Case:
    return Case.build(_spec(name, **dict(CAUSAL[name])), dtype)


def assert_calls_are_rows_of_the_full_pass(case: Case, schedule: list[int]) -> None:
    full = NumpyMHA().run(case)
    calls = schedule_calls(schedule, case.tgt_len, case.src_len)
    eps = float(np.finfo(np.float32 if case.dtype != "float64" else np.float64).eps)
    if case.dtype in ("float16", "bfloat16"):
        eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[case.dtype]
    for c, (out, (t0, t1, cache_len, _)) in enumerate(zip(decode_calls(case, calls), calls)):
        assert set(out) == set(full), (c, sorted(set(full) ^ set(out)))
        for stage, got in out.items():
            want = call_view(stage, np.asarray(full[stage], dtype=np.float64), t0, t1, cache_len)
            got = np.asarray(got, dtype=np.float64)
            where = f"{case.id} {case.dtype} call {c + 1} of {len(calls)} (rows {t0}:{t1}, cache {cache_len}) {stage}"
            assert got.shape == want.shape, f"{where}: shape {got.shape}, the full pass's {want.shape}"
            finite = np.isfinite(want)
            assert np.array_equal(finite, np.isfinite(got)), where
            scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-300)
            err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
            assert err <= ULPS * eps * scale, f"{where}: {err:.3g} > {ULPS} ulps of {scale:.3g}"


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_each_call_is_rows_of_the_full_pass_float64(name, schedule):
    assert_calls_are_rows_of_the_full_pass(causal_case(name, "float64"), SCHEDULES[schedule])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["everything", "gpt_oss", "rope_offsets_gqa", "sinks_masked_rows"])
def test_each_call_is_rows_of_the_full_pass_in_the_dtype(name, dtype):
    assert_calls_are_rows_of_the_full_pass(causal_case(name, dtype), SCHEDULES["chunks"])


def test_the_cache_is_held_in_the_dtype_and_grows_by_the_call():
    case = causal_case("rope_offsets_gqa", "float16")
    outs = decode_calls(case, schedule_calls([2, 1, 2], case.tgt_len, case.src_len))
    assert [o["k_rot"].shape[1] for o in outs] == [4, 5, 7]  # P = 2 past keys, then the calls' rows
    assert all(o[s].dtype == np.float16 for o in outs for s in ("k_proj", "k_rot", "v_proj"))
    assert [o["scores"].shape for o in outs] == [(2, 4, 2, 4), (2, 4, 1, 5), (2, 4, 2, 7)]


def test_the_catalog_schedule_cases_conform_call_by_call():
    """Through the runner: decode(case) on the built-in schedule cases, every call judged and passing."""
    import mhaspec
    from mhaspec.spec import CATALOG

    ids = [cid for cid in CATALOG.ids() if CATALOG[cid].schedule is not None]
    assert ids
    report = mhaspec.check("numpy", cases=ids, dtypes=["float32", "bfloat16"], isolate=False, timeout=None)
    for r in report.results:
        assert r.verdict == "pass", (r.case, r.dtype, r.message)
        assert [c.call for c in r.calls] == list(range(1, len(CATALOG[r.case].schedule) + 1)), r.case
        assert all(c.verdict == "pass" for c in r.calls), r.case
