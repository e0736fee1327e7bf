"""The golden lse's bound where the C library's attention loop forms its row operands (csrc/attention_rows.h:
mh_attention_lse_chunk; compiled.lse_of_rows finishes them by model.variants' formulas) against the NumPy
path's (model.variants.scores_lse), on tests/kernel_cases.py's cases, per dtype.

The loop's t² (ws² + s2) is the NumPy path's T_s² = sigma² + (worst − floor)² up to roundings (sqrt(s2)²,
(ws + floor) − floor), its sums go in another order and its expm1 is its own (within two ulps of np.expm1:
tests/test_native_local.py measures the shared sums).  So sigma agrees to a relative 1e-14 (7.6e-16 seen),
the worst part to 1e-7 (its exact − first order of the move cancels: 3.4e-11 seen, bfloat16), but for the
rows where the exact bound's −log1p(down) is ill-conditioned (1 + down ~ 1e-11: a weight of 1 on a key with
τ ~ 27, bfloat16 scores of ~500), where both paths are only as close as their sums' roundings over 1 + down
allow (kernel_cases.lse_worst_allowance; 1.5e-6 absolute seen on a worst of 2e-4 where the NumPy path's own
error is 1.3e-6 by a 60-digit evaluation).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mhaspec.conformance import tolerance as tol
from mhaspec.conformance.engine import chunks, compiled
from mhaspec.conformance.model import variants
from mhaspec.reference.onthefly import golden_case
from mhaspec.spec import DTYPES, CaseSpec, MHAConfig

from .kernel_cases import CASES, counted_calls, lse_worst_allowance

native = pytest.importorskip("mhaspec.conformance.engine.native", reason="the C library is not built",
                             exc_type=ImportError)


@pytest.fixture(scope="module")
def goldens():
    return {name: golden_case(spec) for name, spec in CASES.items()}


def _bounds(golden, dtype, monkeypatch, path):
    """tol.golden_bounds by the NumPy loops (``path`` "numpy") or the C library's ("native"), on the
    compiled loops' chunks (a BLAS may sum a product of another chunk height in another order)."""
    with monkeypatch.context() as m:
        m.setattr(chunks, "CHUNK_ELEMENTS", compiled.COMPILED_CHUNK_ELEMENTS)
        m.setattr(compiled, "kernels_for_shape", lambda N, T, S: native if path == "native" else None)
        return tol.golden_bounds(golden, dtype)


def _rel(a, b):
    assert a.shape == b.shape
    assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(a == 0, b == 0)
    fin = np.isfinite(a) & (a != 0)
    return float(np.max(np.abs(a[fin] - b[fin]) / np.abs(a[fin]), initial=0.0))


def assert_golden_lse_close(golden, b0, b1, dtype):
    """The C-folded golden lse bound ``b1`` against the NumPy path's ``b0`` (bounds dicts): the closeness
    stated above."""
    (s0, w0), (s1, w1) = (b0["lse"].sigma, b0["lse"].worst), (b1["lse"].sigma, b1["lse"].worst)
    assert _rel(s0, s1) <= 1e-14
    assert np.array_equal(np.isfinite(w0), np.isfinite(w1)) and np.array_equal(w0 == 0, w1 == 0)
    fin = np.isfinite(w0)
    allowed = 1e-7 * w0 + lse_worst_allowance(golden, b0["scores"], dtype)
    assert np.all(np.abs(w0[fin] - w1[fin]) <= allowed[fin])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_c_golden_lse_is_the_numpy_paths(goldens, name, dtype, monkeypatch):
    golden = goldens[name]
    calls = counted_calls(monkeypatch, native, ("attention_lse_chunk", "attention_chunk"))
    b0 = _bounds(golden, dtype, monkeypatch, "numpy")
    assert calls == []
    b1 = _bounds(golden, dtype, monkeypatch, "native")
    assert {name for name, _ in calls} == {"attention_lse_chunk"} and all(ok for _, ok in calls)
    assert_golden_lse_close(golden, b0, b1, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lse_folding_loop_gives_the_plain_loops_bounds_bit_for_bit(goldens, dtype, monkeypatch):
    """The loop that also forms the lse's operands writes the same bounds and tolerances as the plain one."""
    golden = goldens["cross_gqa_padding"]
    no_lse = dataclasses.replace(golden, stages={k: v for k, v in golden.stages.items() if k != "lse"})
    calls = counted_calls(monkeypatch, native, ("attention_lse_chunk", "attention_chunk"))
    with_lse, without = (_bounds(g, dtype, monkeypatch, "native") for g in (golden, no_lse))
    assert {name for name, _ in calls} == {"attention_lse_chunk", "attention_chunk"}
    for stage in without:
        assert np.array_equal(with_lse[stage].sigma, without[stage].sigma), stage
        assert np.array_equal(with_lse[stage].worst, without[stage].worst), stage


def test_the_rows_finish_by_the_models_formulas(goldens):
    """compiled.lse_of_rows is variants.lse on the same numbers: the rows' operands formed by NumPy
    (variants.lse_move, Σ p²·T_s², visible_row_max) through both, bit for bit."""
    golden = goldens["random_mask_blind_rows"]
    rng = np.random.default_rng(5)
    B, H, T, S = golden.visible.shape
    p = golden.stages["attn_weights"].reshape(B * H, T, S)
    s = golden.stages["scores"].reshape(B * H, T, S)
    vis = np.broadcast_to(golden.visible, (B, H, T, S)).reshape(B * H, T, S)
    lse_ = golden.stages["lse"].reshape(B * H, T, 1)
    ts2 = np.where(vis, rng.uniform(0, 1e-6, s.shape) * s * s, 0.0)
    r = tol.rounding("float16", "standard", tol.DEFAULT_TOLERANCES)
    a_s = r.accumulation(S)
    tau = np.sqrt(ts2) * tol.LAMBDA
    first, _ = variants.lse_move(p, tau)
    up = np.sum(p * np.expm1(tau), axis=-1, keepdims=True)
    down = np.sum(p * np.expm1(-tau), axis=-1, keepdims=True)
    pk = np.sum(p * p * ts2, axis=-1, keepdims=True)
    row_max = variants.visible_row_max(np.abs(s), vis)
    rows = np.concatenate([first, up, down, pk, row_max], axis=-1)
    assert rows.shape[-1] == compiled.GOLDEN_LSE_PARTS
    e = compiled.lse_of_rows(rows, lse_, a_s, r)
    expected = variants.lse(p, ts2, np.abs(s), vis, lse_, a_s, r)
    assert np.isneginf(lse_).any()  # its blind rows: 0, as variants.lse
    assert np.array_equal(e.var, expected.var) and np.array_equal(e.acc, expected.acc)


def test_a_chunk_with_a_value_that_is_not_finite_takes_the_numpy_lse(goldens, monkeypatch):
    golden = goldens["self_causal"]
    s = golden.stages["scores"].copy()
    s[0, 1, 200, 3] = np.inf
    wild = dataclasses.replace(golden, stages={**golden.stages, "scores": s})
    calls = counted_calls(monkeypatch, native, ("attention_lse_chunk",))
    b0 = _bounds(wild, "float32", monkeypatch, "numpy")
    b1 = _bounds(wild, "float32", monkeypatch, "native")
    assert {ok for _, ok in calls} == {False, True}  # that chunk fell back, the others did not
    for x0, x1 in ((b0["lse"].sigma, b1["lse"].sigma), (b0["lse"].worst, b1["lse"].worst)):
        assert np.array_equal(np.isnan(x0), np.isnan(x1))
        assert _rel(np.nan_to_num(x0, nan=0.0), np.nan_to_num(x1, nan=0.0)) <= 1e-7


def test_a_case_with_sinks_keeps_the_general_lse_path(monkeypatch):
    """A sink logit per head makes the case a variant: the model's general rule, no compiled loop at all."""
    spec = CaseSpec(id="g_sinks", config=MHAConfig(d_model=16, num_heads=2, causal=True, sinks=True),
                    batch=1, tgt_len=40, src_len=40, inputs="self", seed=9)
    golden = golden_case(spec)
    calls = counted_calls(monkeypatch, native, ("attention_lse_chunk", "attention_chunk"))
    b0, b1 = (_bounds(golden, "float32", monkeypatch, path) for path in ("numpy", "native"))
    assert calls == []
    assert np.array_equal(b0["lse"].sigma, b1["lse"].sigma) and np.array_equal(b0["lse"].worst, b1["lse"].worst)
