"""The C library's local loops (csrc/local.c) give the numba loops' and the NumPy loops' local checks.

Each C loop is the numba loop term by term: on the same chunk, the same references but for the
softmax's last bits (a relative 1e-14: the polynomials' products fused otherwise, row sums added in
another order) and the bounds to a relative 1e-10 (2.3e-12 seen).  Through :func:`tol.local_references`,
against the NumPy loops, the limits of tests/test_kernels.py (the softmax 1e-14, the (B, H, T, S)
bounds 1e-7).  The local lse check, which
the C weights loop folds into its own work (compiled.local_lse), agrees with the NumPy path's to
1e-7 in its bounds (exact − first order of its move cancels) and 1e-14 in lse itself (the same peak;
the exponentials' last bits).
"""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.conformance import tolerance as tol
from mhaspec.conformance.engine import chunks, compiled
from mhaspec.conformance.model import local, variants
from mhaspec.reference.onthefly import golden_case
from mhaspec.spec import CaseSpec, MHAConfig

from .kernel_cases import CASES, counted_calls, local_lse_worst_allowance

native = pytest.importorskip("mhaspec.conformance.engine.native", reason="the C library is not built",
                             exc_type=ImportError)

#: the stages an adapter returns rounded to float32 (its own inputs of every local check)
OWN = ("q_proj", "k_proj", "v_proj", "scores", "attn_weights", "lse")


@pytest.fixture(scope="module")
def goldens():
    return {name: golden_case(spec) for name, spec in CASES.items()}


def _own(golden, stages=OWN, masked=-np.inf):
    """An adapter's own stages, rounded to float32, its masked scores ``masked`` (many kernels return -inf)."""
    own = {stage: golden.stages[stage].astype(np.float32).astype(np.float64) for stage in stages
           if stage in golden.stages}
    if "scores" in own:
        own["scores"][np.broadcast_to(~golden.visible, own["scores"].shape)] = masked
    return own


def _references(golden, own, dtype, monkeypatch, path):
    """tol.local_references by the NumPy loops (``path`` "numpy"), or with the C library's loops forced
    ("native"), on the compiled loops' chunks (a BLAS may sum a product of another chunk height in another order)."""
    with monkeypatch.context() as m:
        m.setattr(chunks, "CHUNK_ELEMENTS", compiled.COMPILED_CHUNK_ELEMENTS)
        m.setattr(compiled, "kernels_for_shape", lambda N, T, S: native if path == "native" else None)
        return tol.local_references(golden, own, dtype)


def _rel(a, b):
    assert a.shape == b.shape
    assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(a == 0, b == 0)
    fin = np.isfinite(a) & (a != 0)
    return float(np.max(np.abs(a[fin] - b[fin]) / np.abs(a[fin]), initial=0.0))


# --- each loop against numba's, on the same chunk -----------------------------------------------------

def _chunk(golden, rows=slice(0, 64), masked=-np.inf):
    """(scores (N, R, S) as an adapter returned them, visibility (N, R, S) broadcast over the heads where the
    case's is) of a chunk of ``golden``'s query rows."""
    B, H, T, S = golden.visible.shape
    s = _own(golden, ("scores",), masked)["scores"].reshape(B * H, T, S)[:, rows]
    vis = golden.visible.reshape(B * H, T, S)[:, rows]
    return np.ascontiguousarray(s), vis


def _weights_args(s, vis, S_seen):
    n, R, S = s.shape
    return [s, vis, 2.0**-48, 2.0**-24 * 1.5, 3e-7, 1e-7, 1e-30, np.zeros((n, R, S)), np.zeros((n, R, S)),
            np.zeros((n, R, S)), np.zeros((8, S)), S_seen]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_c_local_weights_loop_is_numbas(goldens, name):
    kernels = pytest.importorskip("mhaspec.conformance.engine.kernels", reason="numba is not installed")
    from mhaspec.spec.masks import seen_keys

    s, vis = _chunk(goldens[name], rows=slice(0, 130))
    # numba's loop with its declared signature's contiguous visibility: a broadcast one, met first in a process,
    # would compile another signature beside the declared one, which tests/test_kernels.py's later calls would
    # then find ambiguous (kernels.declared); the C loop reads the broadcast view itself
    a = _weights_args(s, vis, seen_keys(vis))
    b = _weights_args(s, np.ascontiguousarray(vis), seen_keys(vis))
    assert native.call("local_weights_chunk", *a) and kernels.call("local_weights_chunk", *b)
    # the softmax: mh_exp and numba's _exp fused otherwise, the row sum in another order
    assert _rel(b[7], a[7]) <= 1e-14
    for k in (8, 9):  # sums in another order, and Σ_k p_k²t_k² − p_j²t_j² cancels where p_j leads (2.3e-12 seen)
        assert _rel(b[k], a[k]) <= 1e-10


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_c_local_scores_and_outputs_loops_are_numbas(goldens, name):
    kernels = pytest.importorskip("mhaspec.conformance.engine.kernels", reason="numba is not installed")
    rng = np.random.default_rng(7)
    n, R, S, k = 3, 17, 90, 71
    ref = rng.standard_normal((n, R, S))
    m_sig, m_wor = (np.abs(rng.standard_normal((n, R, k))).astype(np.float32) for _ in range(2))

    def scores_args():
        return [ref.copy(), m_sig, m_wor, 0.125, 3e-15, 2**-47, 2e-7, 1e-8, 1e-30, np.ones((n, R, S)),
                np.ones((n, R, S)), k]

    a, b = scores_args(), scores_args()
    assert native.call("local_scores_chunk", *a) and kernels.call("local_scores_chunk", *b)
    assert np.array_equal(a[0], b[0]) and not a[0][..., k:].any()
    assert _rel(b[9], a[9]) <= 1e-15 and np.array_equal(a[10], b[10]) and not a[9][..., k:].any()

    pc = goldens[name].stages["attn_weights"][0]
    out_a = [np.empty(pc.shape, np.float32) for _ in range(2)]
    out_b = [np.empty(pc.shape, np.float32) for _ in range(2)]
    assert native.call("local_outputs_operands", pc, *out_a) and kernels.call("local_outputs_operands", pc, *out_b)
    assert all(np.array_equal(x, y) for x, y in zip(out_a, out_b))
    wild = pc.copy()
    wild[1, 2, 3] = np.nan
    assert not native.call("local_outputs_operands", wild, *out_a)


def test_a_chunk_with_a_score_that_is_not_finite_says_so(goldens):
    s, vis = _chunk(goldens["self_causal"])
    for bad in (np.nan, np.inf):
        wild = s.copy()
        wild[1, 5, 2] = bad  # a visible key of row 5 (causal: keys 0 … 5)
        for name, extra in (("local_weights_chunk", []), ("local_weights_lse_chunk", [np.zeros((*s.shape[:2], 7))])):
            assert not native.call(name, *_weights_args(wild, vis, s.shape[-1]), *extra), (name, bad)
        masked = s.copy()
        masked[1, 5, 200] = bad  # a masked key: takes no part
        assert native.call("local_weights_chunk", *_weights_args(masked, vis, s.shape[-1]))


# --- through tol.local_references, against the NumPy loops --------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_c_local_checks_are_the_numpy_ones(goldens, name, dtype, monkeypatch):
    golden = goldens[name]
    own = _own(golden)
    calls = counted_calls(monkeypatch, native, ("local_weights_lse_chunk", "local_scores_chunk", "local_outputs_operands"))
    by_numpy = _references(golden, own, dtype, monkeypatch, "numpy")
    assert calls == []
    by_c = _references(golden, own, dtype, monkeypatch, "native")
    assert {name for name, _ in calls} == {"local_weights_lse_chunk", "local_scores_chunk", "local_outputs_operands"}
    assert all(ok for _, ok in calls)
    assert set(by_numpy) == set(by_c) >= {"scores", "attn_weights", "lse", "head_outputs"}
    for stage in by_numpy:
        (r0, b0), (r1, b1) = by_numpy[stage], by_c[stage]
        if stage == "scores":  # masked scores are not compared; past the keys a chunk sees the C loop leaves 0
            r0, r1, *bounds = (np.where(golden.visible, x, 0.0) for x in (r0, r1, *b0, *b1))
            b0, b1 = bounds[:2], bounds[2:]
        # the softmax and lse: the exponentials' last bits (mh_exp within two ulps, as np.exp)
        assert _rel(r0, r1) <= 1e-14, stage
        # scores: the same formula in one sweep; the others 1e-7, as tests/test_kernels.py: the lse's worst part
        # holds exact − first order of its move (model.variants.lse_move), a cancellation of sums that the C
        # loop adds in another order with its own expm1 (2.9e-8 seen, bfloat16, AVX-512), and where 1 + down is
        # tiny, log1p's condition on top (kernel_cases.move_allowance: 3.65e-7 relative seen in one bfloat16 row
        # of random_mask_blind_rows with the AVX2 build)
        limit = 1e-12 if stage == "scores" else 1e-7
        if stage == "lse":
            assert _rel(b0[0], b1[0]) <= limit, stage
            allowed = limit * np.abs(b0[1]) + local_lse_worst_allowance(golden, own["scores"], by_numpy["attn_weights"][0],
                                                                      dtype)
            assert np.array_equal(np.isfinite(b0[1]), np.isfinite(b1[1]))
            fin = np.isfinite(b0[1])
            assert np.all(np.abs(b0[1] - b1[1])[fin] <= allowed[fin]), stage
            continue
        assert _rel(b0[0], b1[0]) <= limit and _rel(b0[1], b1[1]) <= limit, stage


@pytest.mark.parametrize("with_weights", [True, False])
def test_the_folded_lse_check_is_the_numpy_ones_with_and_without_the_weights_stage(goldens, with_weights,
                                                                                   monkeypatch):
    golden = goldens["random_mask_blind_rows"]  # fully masked rows: lse −inf, nothing but the floor
    own = _own(golden, ("scores", "lse", *(("attn_weights",) if with_weights else ())))
    calls = counted_calls(monkeypatch, native, ("local_weights_lse_chunk", "local_weights_chunk"))
    (r0, b0), (r1, b1) = (_references(golden, own, "float16", monkeypatch, path)["lse"] for path in ("numpy", "native"))
    assert {name for name, _ in calls} == {"local_weights_lse_chunk"}
    assert np.isneginf(r0).any() and _rel(r0, r1) <= 1e-14
    blind = np.isneginf(r1)
    assert not b1.sigma[blind].any() and np.array_equal(b1.worst[blind], b0.worst[blind])
    assert _rel(b0.sigma, b1.sigma) <= 1e-12 and _rel(b0.worst, b1.worst) <= 1e-7


def test_a_chunk_with_a_nan_score_takes_the_numpy_path_for_the_weights_and_the_lse(goldens, monkeypatch):
    golden = goldens["self_causal"]
    own = _own(golden, ("scores", "attn_weights", "lse"))
    own["scores"][1, 2, 40, 3] = np.nan
    calls = counted_calls(monkeypatch, native, ("local_weights_lse_chunk",))
    by_numpy = _references(golden, own, "float32", monkeypatch, "numpy")
    by_c = _references(golden, own, "float32", monkeypatch, "native")
    assert {ok for _, ok in calls} == {False, True}  # that chunk fell back, the others did not
    for stage in ("attn_weights", "lse"):
        (r0, b0), (r1, b1) = by_numpy[stage], by_c[stage]
        assert np.array_equal(r0, r1, equal_nan=True) or _rel(np.nan_to_num(r0), np.nan_to_num(r1)) <= 1e-14
        assert not np.isfinite(b1.sigma).all() or not np.isfinite(b1.worst).all() or np.isnan(r1).any(), stage
        for x0, x1 in ((b0.sigma, b1.sigma), (b0.worst, b1.worst)):
            assert np.array_equal(np.isnan(x0), np.isnan(x1)), stage
            assert _rel(np.nan_to_num(x0, nan=0.0), np.nan_to_num(x1, nan=0.0)) <= 1e-7, stage


def test_a_case_with_sinks_keeps_the_general_lse_path(monkeypatch):
    """A sink logit per head makes the case a variant: neither the compiled nor the in-place loops, the lse
    with the sink as a key (model.variants.local_lse), whatever library is loaded."""
    spec = CaseSpec(id="n_sinks", config=MHAConfig(d_model=16, num_heads=2, causal=True, sinks=True),
                    batch=1, tgt_len=40, src_len=40, inputs="self", seed=9)
    golden = golden_case(spec)
    own = _own(golden, ("scores", "lse", "attn_weights"))
    calls = counted_calls(monkeypatch, native, ("local_weights_lse_chunk", "local_weights_chunk"))
    (r0, b0), (r1, b1) = (_references(golden, own, "float32", monkeypatch, path)["lse"] for path in ("numpy", "native"))
    assert calls == []
    assert np.array_equal(r0, r1) and np.array_equal(b0.sigma, b1.sigma) and np.array_equal(b0.worst, b1.worst)


# --- the expm1 of the lse's exact bound -----------------------------------------------------------------

def test_the_lse_sums_are_within_the_numpy_expm1s_rounding():
    """Σ p (e^{±τ} − 1) of the C loop (its expm1: a polynomial, one reduction above ln2/2) against NumPy's
    np.expm1 sums, over τ from 2^-40 to 350 (the short polynomial's rows and the general ones): within
    a relative 4·S ulps, the summation's own bound."""
    rng = np.random.default_rng(11)
    S = 257
    for top in (2.0**-40, 2.0**-20, 2.0**-8, 2.0**-7, 0.3, 0.35, 0.8, 3.0, 40.0, 349.0, 400.0):
        s = rng.uniform(-1, 1, (4, 3, S)) * top / 8 / 2.0**-6.5
        vis = np.ones(s.shape, bool)
        parts = np.zeros((4, 3, 7))
        args = _weights_args(s, vis, S)
        args[2] = 2.0**-13  # u² of a float16-like dtype: τ = LAMBDA·|s|·sqrt(u² + U64²) = |s|·2^-3.5·…
        assert native.call("local_weights_lse_chunk", *args, parts)
        p = args[7]
        tau = np.sqrt((s * s) * (args[2] + 2.0**-106)) * 8
        t = np.minimum(tau, 350.0)
        up = np.sum(p * np.expm1(t), axis=-1)
        down = np.sum(p * np.expm1(-t), axis=-1)
        eps = np.finfo(float).eps
        assert np.all(np.abs(parts[..., 3] - up) <= 4 * S * eps * np.abs(up)), top
        assert np.all(np.abs(parts[..., 4] - down) <= 4 * S * eps * np.abs(down)), top
        assert np.all(np.abs(parts[..., 2] - np.sum(p * tau, axis=-1)) <= 4 * S * eps * np.sum(p * tau, axis=-1))


def test_the_lse_rows_finish_by_the_models_formulas():
    """compiled.local_lse is variants.lse on the same numbers: a chunk's rows through both."""
    rng = np.random.default_rng(12)
    s = rng.standard_normal((2, 5, 33)) * 4
    vis = rng.random(s.shape) < 0.7
    vis[0, 1] = False  # a blind row
    parts = np.zeros((2, 5, 7))
    r = tol.rounding("float16", "standard", tol.DEFAULT_TOLERANCES)
    a_s = r.accumulation(33)
    args = _weights_args(s, vis, s.shape[-1])
    args[2:7] = r.u**2, r.acc, a_s.worst, a_s.sigma, r.floor
    assert native.call("local_weights_lse_chunk", *args, parts)
    ref, e = compiled.local_lse(parts, a_s, r)
    expected_ref, expected = variants.local_lse(s, vis, None, r, False)
    assert _rel(ref, expected_ref) <= 1e-14
    bound = local.local_bound(e, r, False)
    assert _rel(expected.sigma, bound.sigma) <= 1e-12 and _rel(expected.worst, bound.worst) <= 1e-12
