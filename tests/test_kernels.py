"""The compiled chunk loops (the library built at install time, engine/native.py, and numba's, the
``fast`` extra: each check below runs on each of them that is there) give the NumPy loop's bounds.

Both compute the same formulas; they differ in the order of the bounds' own float64
roundings (row sums), in the exponentials (the loops' own, vectorisable, within EXP_ULPS like
numpy's; exp(ℓ)·exp(ρ), rounded up, for exp(ℓ + ρ)) and, through those, in an occasional
float32 rounding of a bound product.  So the bounds agree to a relative 1e-6 at worst (the
head outputs' variance is a difference of products) and the (B, H, T, S) ones to 1e-7; the
verdicts are the same (benchmarks/compiled_figures.py shows it on every variant of
tests/variants.py, per dtype).

Both loops are compared on the same chunks: a BLAS may sum a float32 product of another chunk
height in another order (OpenBLAS does on AVX-512 CPUs: up to a relative 1.8e-7 in the scores'
bounds here, 1.5e-6 in the head outputs'), a difference of the BLAS, not of the loops.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys

import numpy as np
import pytest

from mhaspec.conformance import tolerance as tol
from mhaspec.conformance.engine import chunks, compiled
from mhaspec.conformance.model import softmax
from mhaspec.conformance.model.vocabulary import Bound
from mhaspec.reference.onthefly import golden_case
from mhaspec.spec import DTYPES, STAGES, masks

from .kernel_cases import CASES, counted_calls, lse_worst_allowance

#: The compiled loops' implementations here (their module in mhaspec.conformance.engine): numba's where it
#: is installed, the library's where it is built; found without importing either (a module imported at
#: collection would be "loaded" for every other test of the session: compiled.loaded_kernels).
IMPLEMENTATIONS = {name: module for name, module, needs in (("numba", "kernels", "numba"),
                                                            ("native", "native", "mhaspec.conformance.engine._loops"))
                   if importlib.util.find_spec(needs) is not None}
if not IMPLEMENTATIONS:
    pytest.skip("neither numba (the fast extra) nor the compiled library is installed", allow_module_level=True)


@pytest.fixture(scope="module", params=sorted(IMPLEMENTATIONS))
def kernels(request):
    """Each implementation of the compiled loops (a module with kernels.py's loops and ``call``)."""
    return importlib.import_module(f"mhaspec.conformance.engine.{IMPLEMENTATIONS[request.param]}")


@pytest.fixture
def numba_kernels():
    """numba's loops, for what only they have (declared signatures, conversions)."""
    return pytest.importorskip("mhaspec.conformance.engine.kernels", reason="numba (the fast extra) is not installed")


@pytest.fixture(autouse=True)
def _compiled_from_smaller_cases(request, monkeypatch):
    """The cases here are smaller than the compiled loops' thresholds (cases that pay back numba's
    compilation): lowered, so that they take them, fast.  A test of numba's loops runs as where the
    library is not built (the library would take the case first)."""
    monkeypatch.setattr(compiled, "COMPILED_MIN_ELEMENTS", 1 << 19)
    monkeypatch.setattr(compiled, "NATIVE_MIN_ELEMENTS", 1 << 19)
    monkeypatch.delenv(compiled.LOOPS_ENV, raising=False)
    numba = "numba_kernels" in request.fixturenames or (
        "kernels" in request.fixturenames and compiled._name(request.getfixturevalue("kernels")) == "numba")
    if numba:
        monkeypatch.setattr(compiled, "_native", lambda: None)
        monkeypatch.delitem(sys.modules, "mhaspec.conformance.engine.native", raising=False)  # loaded_kernels


@pytest.fixture(scope="module")
def goldens():
    return {name: golden_case(spec) for name, spec in CASES.items()}


def _both(golden, dtype, monkeypatch):
    """(NumPy loop, compiled loop) results of tol.judging_bounds, and how many chunks the compiled loop took."""
    calls = []
    real = compiled.attention_chunk

    def counted(*args, **kwargs):
        ok = real(*args, **kwargs)
        calls.append(ok)
        return ok

    monkeypatch.setattr(compiled, "attention_chunk", counted)
    # both loops on the same chunks: a BLAS may sum a float32 bound product of another chunk height in
    # another order (OpenBLAS does on AVX-512 CPUs), a last-bit difference that is not the loops' own
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", compiled.COMPILED_CHUNK_ELEMENTS)
    monkeypatch.setenv(compiled.LOOPS_ENV, "numpy")
    numpy_loop = tol.judging_bounds(golden, dtype)
    assert calls == []
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    compiled_loop = tol.judging_bounds(golden, dtype)
    return numpy_loop, compiled_loop, calls


def _compared(golden, stage: str, x: np.ndarray) -> np.ndarray:
    """``x`` where ``stage`` is compared: masked scores are not, and past the last key a chunk's rows see
    (spec.masks.seen_keys: the padded keys of cross_gqa_padding's second batch entry, a causal case's later keys)
    the compiled loops leave their bounds and local reference 0."""
    return np.where(golden.visible, x, 0.0) if stage == "scores" else x


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    assert np.array_equal(np.isfinite(a), np.isfinite(b)) and np.array_equal(a == 0, b == 0)
    fin = np.isfinite(a) & (a != 0)
    return float(np.max(np.abs(a[fin] - b[fin]) / np.abs(a[fin]), initial=0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_compiled_loop_gives_the_numpy_loops_bounds_and_tolerances(goldens, name, dtype, kernels, monkeypatch):
    golden = goldens[name]
    (b0, t0), (b1, t1), calls = _both(golden, dtype, monkeypatch)
    assert calls and all(calls), "the compiled loop must have judged every chunk"
    assert list(b0) == list(b1) and list(t0) == list(t1)
    hidden = ~golden.visible
    for stage in b0:
        limit = 1e-7 if stage in ("scores", "attn_weights") else 1e-6
        (s0, w0, tt0), (s1, w1, tt1) = ((_compared(golden, stage, x) for x in (b[stage].sigma, b[stage].worst,
                                                                                t[stage]))
                                        for b, t in ((b0, t0), (b1, t1)))
        assert _rel(s0, s1) <= limit, stage
        # the worst part against the whole tolerance: under the probabilistic accumulation it can be
        # only the second-order term, 1e-12 of the tolerance, whose closed form the loops evaluate
        # with other exponentials (a few % apart there, each an upper bound of the exact term)
        assert np.array_equal(np.isfinite(w0), np.isfinite(w1)), stage
        fin = np.isfinite(w0)
        assert np.all(np.abs(w0[fin] - w1[fin]) <= limit * tt0[fin]), stage
        assert _rel(tt0, tt1) <= limit, stage
    # masked weights: no allowance at all, in both
    assert not b1["attn_weights"].sigma[hidden].any() and not b1["attn_weights"].worst[hidden].any()


@pytest.mark.parametrize("numba", ["on", "off"])
def test_the_lse_bounds_by_chunks_of_rows_are_those_of_the_whole_stage(goldens, numba, kernels, monkeypatch):
    """The golden lse's bound, formed chunk by chunk from each chunk's score bounds, and the local lse's,
    chunk by chunk from the adapter's own scores: every term is per row, so the numbers of the whole
    stage at once (variants.spec11_lse, variants.local_lse), bit for bit; each where the library's loop forms
    it (the attention loop the golden one, the weights loop the local one), to that loop's closeness."""
    from mhaspec.conformance.model import variants

    golden = goldens["cross_gqa_padding"]
    monkeypatch.setenv(tol.NUMBA_ENV, numba)
    bounds = tol.golden_bounds(golden, "float32")
    r = tol.rounding("float32", "standard", tol.DEFAULT_TOLERANCES)
    whole = variants.spec11_lse(golden, bounds["scores"], r).bound(r.floor)
    loops = compiled.kernels_for(golden) if numba == "on" else None
    if loops is not None and compiled.folds_golden_lse(loops):
        # the library's attention loop formed the golden lse's row sums (its own t², expm1, sums' order): the
        # closeness tests/test_native_golden_lse.py states (sigma 1e-14, the worst part 1e-7 but for its
        # ill-conditioned rows)
        assert _rel(bounds["lse"].sigma, whole.sigma) <= 1e-14
        allowed = 1e-7 * whole.worst + lse_worst_allowance(golden, bounds["scores"], "float32")
        assert np.array_equal(np.isfinite(whole.worst), np.isfinite(bounds["lse"].worst))
        fin = np.isfinite(whole.worst)
        assert np.all(np.abs(bounds["lse"].worst - whole.worst)[fin] <= allowed[fin])
    else:
        assert np.array_equal(bounds["lse"].sigma, whole.sigma) and np.array_equal(bounds["lse"].worst, whole.worst)
    own = {stage: golden.stages[stage].astype(np.float32).astype(np.float64) for stage in STAGES}
    ref, bound = tol.local_references(golden, own, "float32")["lse"]
    B, H, T, S = golden.visible.shape
    ref_w, bound_w = variants.local_lse(own["scores"].reshape(B * H, T, S), golden.visible.reshape(B * H, T, S),
                                        None, r, False)
    if loops is not None and compiled.folds_lse(loops):
        # the library's weights loop formed the local lse's row sums (its own exponentials, its sums' order):
        # the softmax's and the weights bounds' closeness (tests/test_native_local.py measures it)
        assert _rel(ref, ref_w.reshape(B, H, T)) <= 1e-14
        assert _rel(bound.sigma, bound_w.sigma.reshape(B, H, T)) <= 1e-7
        assert _rel(bound.worst, bound_w.worst.reshape(B, H, T)) <= 1e-7
        return
    assert np.array_equal(ref, ref_w.reshape(B, H, T))
    assert np.array_equal(bound.sigma, bound_w.sigma.reshape(B, H, T))
    assert np.array_equal(bound.worst, bound_w.worst.reshape(B, H, T))


def test_tolerances_alone_are_those_formed_with_the_bounds(goldens, kernels, monkeypatch):
    golden = goldens["cross_gqa_padding"]
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    _, with_bounds = tol.judging_bounds(golden, "bfloat16")
    alone = tol.stage_tolerances(golden, "bfloat16", reference_error=True)
    for stage, t in with_bounds.items():
        assert np.array_equal(t, alone[stage]), stage


def test_a_chunk_with_a_value_that_is_not_finite_takes_the_general_path(goldens, kernels, monkeypatch):
    golden = goldens["self_causal"]
    s = golden.stages["scores"].copy()
    s[0, 1, 200, 3] = np.inf  # an adapter's wild value, as a local check or a deviation bound may see
    wild = dataclasses.replace(golden, stages={**golden.stages, "scores": s})
    # the general path takes float64 products for a whole chunk with a value that is not finite:
    # the same chunks in both runs, so that the same rows do
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", compiled.COMPILED_CHUNK_ELEMENTS)
    (b0, t0), (b1, t1), calls = _both(wild, "float32", monkeypatch)
    assert False in calls and True in calls  # that chunk fell back, the others did not
    for stage in b0:
        assert _rel(t0[stage], t1[stage]) <= 1e-6, stage


def test_small_cases_and_the_switch_keep_the_numpy_loop(kernels, monkeypatch):
    monkeypatch.undo()  # the thresholds as shipped
    if compiled._name(kernels) == "numba":
        monkeypatch.setattr(compiled, "_native", lambda: None)  # as where the library is not built
    monkeypatch.delenv(compiled.LOOPS_ENV, raising=False)
    monkeypatch.delenv(tol.NUMBA_ENV, raising=False)
    assert compiled.kernels_for_shape(8, 128, 128) is None  # the committed catalog's sizes: bit-identical bounds
    assert compiled.kernels_for_shape(8, 2048, 2048) is kernels
    for switch, value in ((tol.NUMBA_ENV, "off"), (compiled.LOOPS_ENV, "numpy")):
        with monkeypatch.context() as m:
            m.setenv(switch, value)
            assert compiled.kernels_for_shape(8, 2048, 2048) is None
    # asked for by name: for every case, whatever its size
    monkeypatch.setenv(compiled.LOOPS_ENV, compiled._name(kernels))
    assert compiled.kernels_for_shape(8, 128, 128) is kernels


def test_the_thresholds_keep_the_numpy_loops_where_they_must(monkeypatch):
    """The library from NATIVE_MIN_ELEMENTS (no compilation: far below numba's threshold), never for
    the committed catalog's cases (at most 2^15 elements), which keep the NumPy loops' bounds bit for bit."""
    monkeypatch.undo()  # the thresholds as shipped
    assert compiled.NATIVE_MIN_ELEMENTS >= 1 << 15
    assert compiled.NATIVE_MIN_ELEMENTS < compiled.COMPILED_MIN_ELEMENTS


def test_the_exponential_product_stays_above_the_exponential_of_the_sum(kernels):
    """The closed form's exp(ℓ)·(exp(ρ)·EXP_PRODUCT), as the loop forms it (its own exponential),
    against exp(ℓ + ρ) to 40 digits (decimal), over the range the loop uses."""
    import decimal

    decimal.getcontext().prec = 40
    rng = np.random.default_rng(11)
    ell, rho = (rng.uniform(0, 350, 4000) * rng.random(4000) ** 8 for _ in range(2))  # most of them small
    for a, b in zip(ell, rho):
        got = kernels._exp(float(a)) * (kernels._exp(float(b)) * kernels.EXP_PRODUCT)
        assert decimal.Decimal(got) >= (decimal.Decimal(float(a)) + decimal.Decimal(float(b))).exp(), (a, b)


def test_the_compiled_exponential_is_within_the_references_exp_ulps(kernels):
    """The loops' own exponential (vectorisable, unlike libm's) against the correctly rounded exp
    (decimal, 40 digits): within EXP_ULPS, the accuracy the model assumes of numpy's exp
    (mhaspec.reference.fast), over the whole range, subnormal results included."""
    import decimal

    from mhaspec.reference.fast import EXP_ULPS

    decimal.getcontext().prec = 40
    rng = np.random.default_rng(12)
    xs = np.concatenate([rng.uniform(-1, 1, 2000), rng.uniform(-745, 709.7, 3000),
                         rng.uniform(-745.1, -708, 1000), rng.uniform(-1e-9, 1e-9, 200),
                         [0.0, -0.0, 1.0, -1.0, 709.78, -744.4, 0.5 * np.log(2), -0.5 * np.log(2)]])
    worst = 0.0
    for x in xs:
        exact = decimal.Decimal(float(x)).exp()
        nearest = float(exact)  # the correctly rounded value
        ulp = decimal.Decimal(float(np.spacing(nearest)))
        worst = max(worst, float(abs(decimal.Decimal(kernels._exp(float(x))) - exact) / ulp))
    assert worst <= EXP_ULPS, worst
    assert np.isnan(kernels._exp(np.nan)) and kernels._exp(np.inf) == np.inf and kernels._exp(-np.inf) == 0.0
    assert kernels._exp(709.8) == np.inf and kernels._exp(-746.0) == 0.0 and kernels._exp(0.0) == 1.0


@pytest.mark.parametrize("row", [
    [0.0, 1.0, 1e-20, 3e-17, 0.0],  # one key holds the row: Σ - a_j would be 0 for it
    [0.25, 0.5, 0.5, 1e-18],  # the largest term twice: it counts for the other one
    [0.0, 0.0, 0.0],  # a fully masked row
    [2.0**-1074, 1e300, 7.0],
])
def test_the_others_sum_of_the_exact_bound_needs_no_cancellation(row, kernels):
    """_others_sum (sum, top) gives Σ_{k≠j} a_k for every key j as model.softmax.others does, which a
    math.fsum over the other keys checks."""
    import math

    a = np.array(row)
    total, top = kernels._others_sum(a, a.size)
    assert top == a.max()
    for j, x in enumerate(a):
        others = total if x >= top else max((total - x) + top, 0.0)
        exact = math.fsum(np.delete(a, j))
        assert abs(others - exact) <= 4 * np.finfo(float).eps * exact, (j, others, exact)
    assert np.allclose(softmax.others(a[None]), [[total if x >= top else (total - x) + top for x in a]],
                       rtol=4 * np.finfo(float).eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_compiled_local_weights_check_is_the_numpy_ones(goldens, name, dtype, kernels, monkeypatch):
    """The local attention-weights check from an adapter's own scores (rounded to the dtype; masked
    ones -inf, as many kernels return them): the same reference and bound."""
    golden = goldens[name]
    s = golden.stages["scores"].astype(np.float32).astype(np.float64)
    s[~golden.visible] = -np.inf
    # the library's loop that also forms the local lse where the golden has that stage, else the plain one
    loops = ["local_weights_chunk"] + (["local_weights_lse_chunk"] if compiled.folds_lse(kernels) else [])
    calls = counted_calls(monkeypatch, kernels, loops)
    monkeypatch.setenv(compiled.LOOPS_ENV, "numpy")
    ref0, b0 = tol.local_references(golden, {"scores": s}, dtype)["attn_weights"]
    assert calls == []
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    ref1, b1 = tol.local_references(golden, {"scores": s}, dtype)["attn_weights"]
    assert calls and all(ok for _, ok in calls)
    assert _rel(ref0, ref1) <= 1e-14  # the softmax itself: the exponentials' last bits
    assert _rel(b0.sigma, b1.sigma) <= 1e-7 and _rel(b0.worst, b1.worst) <= 1e-7


def test_a_loop_that_cannot_run_warns_once_and_leaves_the_numpy_loops(goldens, kernels, monkeypatch):
    """A loop numba cannot compile, or the library refuses (native.NativeError): one warning that names
    the implementation, the NumPy loops' tolerances, and that implementation not tried again."""
    golden = goldens["self_causal"]
    # the NumPy loops on the compiled loop's chunks, as the fallback takes them (see _both)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", compiled.COMPILED_CHUNK_ELEMENTS)
    monkeypatch.setenv(compiled.LOOPS_ENV, "numpy")
    expected = tol.stage_tolerances(golden, "float16", reference_error=True)
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    monkeypatch.setattr(compiled, "_BROKEN", {})

    tries = []
    if compiled._name(kernels) == "numba":
        from numba.core.errors import TypingError as error

        message, named = "numba could not compile the tolerance loop .*TypingError", "numba"
    else:
        error = kernels.NativeError
        message, named = r"the compiled loops' library \(.*_loops\) could not run attention_(lse_)?chunk .*NativeError", "library"

    def broken(*args):
        tries.append(1)
        raise error("Failed in nopython mode pipeline (step: nopython frontend)\nmore")

    monkeypatch.setattr(kernels, "attention_chunk", broken)
    if compiled.folds_golden_lse(kernels):  # the library's loop that also forms the golden lse: the same loop
        monkeypatch.setattr(kernels, "attention_lse_chunk", broken)
    with pytest.warns(RuntimeWarning, match=message) as caught:
        got = tol.stage_tolerances(golden, "float16", reference_error=True)
    assert len([w for w in caught if named in str(w.message)]) == 1
    # once per thread at most (those that started before the first failure), not once per chunk
    assert len(tries) <= min(chunks.threads(), len(chunks.chunks(8, 300, 300, compiled.COMPILED_CHUNK_ELEMENTS)) - 1)
    for stage, t in expected.items():
        assert np.array_equal(t, got[stage]), stage  # the NumPy loops' tolerances, bit for bit
    assert compiled.kernels_for_shape(8, 2048, 2048) is not kernels  # not tried again in this process


def _local_calls(kernels, monkeypatch) -> list[tuple[str, bool]]:
    """(kernel, what it returned) of every call of the local scores and head-outputs loops, from now on."""
    return counted_calls(monkeypatch, kernels, ("local_scores_chunk", "local_outputs_operands"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_compiled_local_scores_and_head_outputs_checks_are_the_numpy_ones(goldens, name, dtype, kernels, monkeypatch):
    """The local scores check (from the adapter's own projections) and head-outputs check (from its
    own weights), both rounded to the dtype: the same references and bounds, every chunk compiled."""
    golden = goldens[name]
    own = {stage: golden.stages[stage].astype(np.float32).astype(np.float64)
           for stage in ("q_proj", "k_proj", "v_proj", "attn_weights")}
    calls = _local_calls(kernels, monkeypatch)
    monkeypatch.setenv(compiled.LOOPS_ENV, "numpy")
    numpy_loop = tol.local_references(golden, own, dtype)
    assert calls == []
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    compiled_loop = tol.local_references(golden, own, dtype)
    assert {fn for fn, _ in calls} == {"local_scores_chunk", "local_outputs_operands"} and all(ok for _, ok in calls)
    assert set(numpy_loop) == set(compiled_loop) >= {"scores", "head_outputs"}
    for stage in ("scores", "head_outputs"):
        (r0, b0), (r1, b1) = ((_compared(golden, stage, r), Bound(*(_compared(golden, stage, x) for x in b)))
                              for r, b in (numpy_loop[stage], compiled_loop[stage]))
        # the same scaling of BLAS products (the scores': of the keys seen, which OpenBLAS rounds alike here)
        assert np.array_equal(r0, r1), stage
        # head_outputs' worst part holds the weights' route allowance (model.local.weights_route), a local
        # weights bound, whose compiled loop agrees to 1e-7 (test_the_compiled_local_weights_check_…)
        worst = 1e-12 if stage == "scores" else 1e-7
        assert _rel(b0.sigma, b1.sigma) <= 1e-12 and _rel(b0.worst, b1.worst) <= worst, stage


def test_a_local_chunk_with_a_value_that_is_not_finite_takes_the_general_path(goldens, kernels, monkeypatch):
    golden = goldens["self_causal"]
    own = {stage: golden.stages[stage].copy() for stage in ("q_proj", "k_proj", "v_proj", "attn_weights")}
    own["q_proj"][0, 5, 3] = np.inf
    own["attn_weights"][1, 2, 7, 9] = np.nan
    calls = _local_calls(kernels, monkeypatch)
    monkeypatch.setenv(compiled.LOOPS_ENV, "numpy")
    numpy_loop = tol.local_references(golden, own, "float16")
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    compiled_loop = tol.local_references(golden, own, "float16")
    for fn in ("local_scores_chunk", "local_outputs_operands"):  # that chunk fell back, the others did not
        assert {ok for f, ok in calls if f == fn} == {False, True}, fn
    for stage in ("scores", "head_outputs"):
        (r0, b0), (r1, b1) = ((_compared(golden, stage, r), Bound(*(_compared(golden, stage, x) for x in b)))
                              for r, b in (numpy_loop[stage], compiled_loop[stage]))
        assert np.array_equal(r0, r1, equal_nan=True), stage
        assert not np.isfinite(b0.sigma).all() or not np.isfinite(b0.worst).all(), stage  # the wild value shows
        assert _rel(b0.sigma, b1.sigma) <= 1e-12 and _rel(b0.worst, b1.worst) <= 1e-12, stage  # in both alike


def test_a_case_judged_in_blocks_takes_the_compiled_loop_by_its_whole_size(goldens, kernels, monkeypatch):
    """judge_in_blocks splits a large case into blocks of query rows below the compiled loop's
    threshold; the loop is chosen by the whole case's size (what pays back its compilation), so
    every block takes it, and the verdicts are those of the case judged at once."""
    from mhaspec.conformance import Session
    from mhaspec.conformance.blocks import judge_in_blocks
    from mhaspec.reference.onthefly import OnTheFlyGolden
    from mhaspec.spec import Catalog

    golden = goldens["self_causal"]  # 2·4·300·300 = 720 000 elements, above the lowered 2^19
    calls = []
    real = compiled.attention_chunk

    def counted(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(compiled, "attention_chunk", counted)
    seen: list[int] = []  # the keys each chunk's rows see (spec.masks.seen_keys): where the loop stops
    monkeypatch.setattr(compiled, "seen_keys", lambda vis: seen.append(masks.seen_keys(vis)) or seen[-1])
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    session = Session("numpy", golden=OnTheFlyGolden(Catalog([CASES["self_causal"]])), timeout=None, isolate=False)
    returned = {name: golden.stages[name].astype(np.float32).astype(np.float64) for name in STAGES}

    def judge(g, r):
        return session.judge_stages(g, "float32", r)

    B, H, T, S = golden.visible.shape
    rows = (1 << 17) // (H * S)  # per block (109)
    blocked = judge_in_blocks(golden, returned, judge, max_elements=1 << 17)
    assert calls and all(calls), "every block must take the compiled loop"
    # causal (T = S): a block of rows sees the keys up to its last row only, and the loops stop there
    assert {min(t0 + rows, S) for t0 in range(0, T, rows)} <= set(seen)
    whole = judge(golden, returned)
    assert [(r.stage, r.verdict) for r in blocked] == [(r.stage, r.verdict) for r in whole]
    assert {r.verdict for r in whole} == {"pass"}
    # the loop stopped at the keys seen: the bounds' own float64 sums and the float32 bound products
    # of fewer terms round otherwise (as another block height's do, tests/test_blocks.py)
    for b, w in zip(blocked, whole):
        assert b.worst_ratio == pytest.approx(w.worst_ratio, rel=1e-6), b.stage
        assert (b.compared, b.max_abs_err, b.max_rel_err) == (w.compared, w.max_abs_err, w.max_rel_err), b.stage



def _both_paths(monkeypatch, *args, **kwargs):
    """compare_stage by the compiled sweep (the loops loaded) and by NumPy (switched off)."""
    from mhaspec.conformance import compare

    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    swept = compare.compare_stage(*args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(compiled, "loaded_kernels", lambda: None)
        by_numpy = compare.compare_stage(*args, **kwargs)
    return dataclasses.asdict(swept), dataclasses.asdict(by_numpy)


@pytest.mark.parametrize("shape", [(1, 8, 64, 1024), (1, 300, 512), (2, 4, 33, 257)])
def test_the_compiled_comparison_gives_the_numpy_figures(shape, kernels, monkeypatch):
    """compare_stage on a large float32/float64 stage, by the compiled sweep and by NumPy: the same
    result field for field (the root mean square to rounding: its sum is in another order), on a
    strided block, masked like scores (visible) and like attention weights (tolerance 0, exactly 0),
    and where a stage fails (NaN, above its tolerance, not a float32 value, systematic)."""
    assert compiled.loaded_kernels() is kernels
    rng = np.random.default_rng(7)
    whole = rng.standard_normal((shape[0], shape[1], 2 * shape[2], *shape[3:]))
    g = whole[:, :, ::2]  # a strided view, as a block of query rows is
    v = (g + rng.standard_normal(g.shape) * 1e-6).astype(np.float32).astype(np.float64)
    tol = np.abs(rng.standard_normal(g.shape)) * 1e-4 + 1e-4
    vis = np.broadcast_to(np.tril(np.ones(g.shape[-2:], bool), g.shape[-1] // 2), g.shape)
    on = lambda a: np.where(vis, a, 0.0)  # noqa: E731
    bad_nan, bad_over, bad_wide = v.copy(), v.copy(), v.copy()
    bad_nan.flat[5], bad_over.flat[9], bad_wide.flat[3] = np.nan, bad_over.flat[9] + 1.0, bad_wide.flat[3] + 1e-12
    cases = []
    for noise in (None, (tol / 3, tol / 10)):
        rms = None if noise is None else 0.6
        cases += [(v, g, tol, "float32", None, noise, rms), (v, g, tol, "float64", None, noise, rms),
                  (v, g, tol, "float32", vis, noise, rms),
                  (on(v), on(g), on(tol), "float32", None, None if noise is None else tuple(map(on, noise)), rms)]
    cases += [(b, g, tol, "float32", None, None, None) for b in (bad_nan, bad_over, bad_wide)]
    cases.append((v, g, tol, "float32", None, (tol / 1e6, tol * 0), 0.6))  # systematic
    verdicts = set()
    for got, gold, t, dtype, visible, noise, rms in cases:
        swept, by_numpy = _both_paths(monkeypatch, "scores", got, gold, t, dtype, visible, noise=noise,
                                      rms_limit=rms)
        rms_swept, rms_numpy = swept.pop("rms_ratio"), by_numpy.pop("rms_ratio")
        assert (rms_swept is None) == (rms_numpy is None)
        assert rms_numpy is None or rms_swept == pytest.approx(rms_numpy, rel=1e-12)
        if swept["verdict"] == "fail":  # its message names the root mean square (3 digits)
            assert swept["message"] == by_numpy["message"] or "systematic" in swept["message"]
            swept.pop("message"), by_numpy.pop("message")
        assert swept == by_numpy
        verdicts.add(swept["verdict"])
    assert verdicts == {"pass", "fail"}


def test_every_kernel_call_of_a_judged_case_converts_to_the_kernels_declared_signature(goldens, numba_kernels,
                                                                                         monkeypatch):
    """The golden bounds and tolerances, the local references and the comparison of a case, in every
    dtype: each kernel call's argument types convert to the kernel's one declared signature
    (kernels.SIGNATURES), so that numba compiles each kernel, and each helper it calls, once per
    process (lazily typed, _emit and ordinary_stage compiled twice in a float32 run)."""
    from mhaspec.conformance import compare

    kernels = numba_kernels
    seen: list[tuple[str, bool]] = []
    real = kernels.call

    def recorded(name, *args):
        seen.append((name, kernels._converts(args, kernels.SIGNATURES[name])))
        return real(name, *args)

    monkeypatch.setattr(kernels, "call", recorded)
    monkeypatch.setenv(compiled.LOOPS_ENV, "auto")
    golden = goldens["self_causal"]
    scores = golden.stages["scores"].astype(np.float32).astype(np.float64)
    own = {stage: golden.stages[stage].astype(np.float32).astype(np.float64)
           for stage in ("q_proj", "k_proj", "v_proj", "scores", "attn_weights")}
    for dtype in DTYPES:
        tol.stage_tolerances(golden, dtype, reference_error=True)
        tol.judging_bounds(golden, dtype)
        tol.local_references(golden, own, dtype)
        limit = np.abs(golden.stages["scores"]) * 1e-3 + 1e-6
        for visible in (None, golden.visible):
            compare.compare_stage("scores", scores, golden.stages["scores"], limit, "float32", visible)
    assert {name for name, _ in seen} == set(kernels.SIGNATURES)
    assert all(converts for _, converts in seen), sorted({name for name, converts in seen if not converts})


def test_arguments_that_do_not_convert_to_the_declared_signature_compile_their_own_types(numba_kernels):
    """A view of other strides where the declared signature says contiguous (an adapter's array, say):
    numba compiles the arguments' own types once, and the loop gives the same numbers."""
    kernels = numba_kernels
    rng = np.random.default_rng(11)
    whole = rng.standard_normal((2, 5, 34))
    strided = whole[:, :, ::2]
    assert not kernels._converts((strided,), kernels.SIGNATURES["local_outputs_operands"][:1])
    fn = kernels.local_outputs_operands
    results, compiled_for = [], []
    for pc in (np.ascontiguousarray(strided), strided, strided):
        sq, ab = np.empty(pc.shape, np.float32), np.empty(pc.shape, np.float32)
        assert kernels.call("local_outputs_operands", pc, sq, ab)
        results.append((sq, ab))
        compiled_for.append(len(fn.signatures))
    assert compiled_for[1] <= compiled_for[0] + 1 and compiled_for[2] == compiled_for[1]  # compiled once
    for sq, ab in results:
        assert np.array_equal(sq, (strided * strided).astype(np.float32))
        assert np.array_equal(ab, np.abs(strided).astype(np.float32))
