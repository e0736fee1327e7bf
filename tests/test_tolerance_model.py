"""Two-sided proof of the tolerance model, per dtype (docs/tolerances.md).

(1) Correct implementations written differently pass every case in every
dtype, with a margin — with every stage exposed and with only ``output``;
(2) realistic bugs are rejected in *every* dtype on every case where they
change the float64 result, at the stage where the bug is; (3) what the
standard precision contract excludes (native float16/bfloat16 accumulation)
fails as "imprecise" and passes ``precision="worst-case"``; (4) a stage the
dtype cannot resolve is "uninformative", never a pass.
"""

from __future__ import annotations

import numpy as np
import pytest

import mhaspec
from mhaspec.conformance import ERROR, FAIL, PASS, Session
from mhaspec.conformance import judging
from mhaspec.conformance.compare import UNINFORMATIVE
from mhaspec.conformance.tolerance import KAPPA
from mhaspec.fixtures import GoldenCase
from mhaspec.spec import CATALOG, DTYPES, STAGE, CaseSpec, MHAConfig

from .reports import judged_cases, report_of
from .variants import BUGS, CORRECT, NATIVE, OUTPUT_ONLY_BUGS, output_only
from .zoo import applies, visible_cases

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)


def _stage_stats(report):
    judged = [st for r in report.results for st in r.stages if st.verdict in (PASS, FAIL)]
    worst = max((st.worst_ratio or 0.0) for st in judged)
    local = max((st.local_worst_ratio or 0.0) for st in judged)
    rms = max((st.rms_ratio or 0.0) for st in judged)
    return worst, local, rms


@pytest.mark.parametrize("name", sorted(CORRECT))
@pytest.mark.parametrize("exposed", ["every stage", "output only"])
def test_correct_implementations_pass_every_case_and_dtype(name, exposed):
    adapter = CORRECT[name] if exposed == "every stage" else output_only(CORRECT[name])
    report = report_of(adapter)
    assert report.ok, report.table()
    assert len(report.results) == 4 * len(judged_cases(adapter))
    assert all(r.verdict == PASS for r in report.results)
    worst, local, rms = _stage_stats(report)
    # A worst ratio above 1/2 or a root-mean-square above 2/3 of its limit would mean a correct
    # implementation comes close to failing.
    assert worst <= 0.5, f"{name}: worst error/tolerance {worst:.3g}"
    assert local <= 0.5, f"{name}: worst local error/tolerance {local:.3g}"
    assert rms <= KAPPA**0.5 / 1.5, f"{name}: root-mean-square error/sigma {rms:.3g}"


def test_native_low_precision_accumulation_is_imprecise_not_wrong():
    adapter = NATIVE["native_low_precision_accumulation"]
    standard = report_of(adapter)
    failing = [r for r in standard.results if r.verdict == FAIL]
    assert failing, "every-partial-sum-in-the-dtype should exceed the standard contract somewhere"
    assert {r.dtype for r in failing} <= {"float16", "bfloat16"}
    for r in failing:
        for st in r.stages:
            if st.verdict == FAIL:
                assert st.imprecise and st.message.startswith("imprecise"), (r.case, r.dtype, st.stage, st.message)
    lenient = report_of(adapter, "worst-case")
    assert lenient.ok, lenient.table()


#: (bug, case, dtype) where the bug is caught, but after its stage, which cannot resolve it there: measured
#: 2026-12-06, the stale online-softmax accumulator on the decode case with RoPE (T = 2, S = 9, blocks of 8:
#: one key in the second block) in float16: head_outputs within its tolerance (worst ratio 0.40, local 0.54),
#: the output failing the systematic-error test (imprecise, worst 0.58).
CAUGHT_LATER = {("online_softmax_stale_accumulator", "rope_offset_decode", "float16"): "output"}


@pytest.mark.parametrize("name", sorted(BUGS) + sorted(OUTPUT_ONLY_BUGS))
def test_bug_is_rejected_at_the_right_stage(name):
    adapter, stage = {**BUGS, **OUTPUT_ONLY_BUGS}[name]
    visible = visible_cases(adapter)
    report = report_of(adapter)
    assert not report.ok, f"bug {name} was not caught"
    for r in report.results:
        if r.verdict == FAIL and applies(adapter, r.dtype):
            # a bug in which keys a row sees changes the log-sum-exp first, where the adapter returns it (lse
            # comes before attn_weights: both are computed from the scores)
            lse_first = stage == STAGE.attn_weights and r.first_failing_stage == STAGE.lse
            later = CAUGHT_LATER.get((name, r.case, r.dtype)) == r.first_failing_stage
            assert r.first_failing_stage == stage or lse_first or later, (
                f"bug {name} on {r.case} [{r.dtype}]: first failing stage should be {stage}, "
                f"got {r.first_failing_stage}"
            )
    for dtype in DTYPES:
        seen = [r for r in report.results if r.dtype == dtype and r.case in visible and applies(adapter, dtype)]
        if seen:
            assert any(r.verdict in (FAIL, ERROR) for r in seen), f"bug {name} is never caught in {dtype}"


def test_detection_rate_per_dtype(capsys):
    """Every bug, full and output-only, on every (case, dtype) where it changes the float64
    result: the share rejected, per dtype.  The issue's bar: at least 95 % in each dtype."""
    totals = {d: [0, 0] for d in DTYPES}
    for adapter, _ in list(BUGS.values()) + list(OUTPUT_ONLY_BUGS.values()):
        visible = visible_cases(adapter)
        for r in report_of(adapter).results:
            if r.case in visible and applies(adapter, r.dtype):
                totals[r.dtype][0] += r.verdict in (FAIL, ERROR)
                totals[r.dtype][1] += 1
    with capsys.disabled():
        print("\nbugs rejected where they change the float64 result: " + ", ".join(
            f"{d} {c}/{n} = {c / n:.1%}" for d, (c, n) in totals.items()))
    for dtype, (caught, count) in totals.items():
        assert count > 0
        assert caught / count >= 0.95, f"{dtype}: only {caught}/{count} rejected"


def test_no_max_subtraction_is_caught_where_exp_overflows():
    adapter, _ = BUGS["softmax_without_max_subtraction"]
    report = mhaspec.check(adapter, cases=["large_logits"], timeout=None)
    verdicts = {r.dtype: r.verdict for r in report.results}
    assert verdicts["float32"] == FAIL and verdicts["float16"] == FAIL
    assert report.result("large_logits", "float32").stage("attn_weights").nonfinite > 0


def test_float16_compute_is_caught_at_float32():
    adapter, _ = BUGS["float16_when_float32_asked"]
    report = mhaspec.check(adapter, dtypes=["float32"], cases=judged_cases(adapter), timeout=None)
    assert all(r.verdict == FAIL and r.first_failing_stage == "q_proj" for r in report.results)


def test_local_check_locates_a_bug_the_golden_check_cannot_resolve():
    """W^O transposed in a square output projection, bfloat16, every stage exposed: the local
    check of output (from the adapter's own concat) names it."""
    adapter, _ = BUGS["w_o_transposed"]
    report = mhaspec.check(adapter, cases=["self_basic"], dtypes=["bfloat16"], timeout=None)
    st = report.result("self_basic", "bfloat16").stage("output")
    assert st.verdict == FAIL and "local" in st.failed_check


class _WithoutScores:
    """A kernel that returns its weights and head outputs but not its scores."""

    def __init__(self, variant):
        self.variant, self.name = variant, variant.name + "-without-scores"

    def run(self, case):
        out = self.variant.run(case)
        out.pop("scores")
        return out


@pytest.mark.parametrize("exposed", ["with its scores", "without its scores"])
def test_weights_recomputed_from_the_lse_pass_the_local_head_outputs_check(exposed):
    """FlashAttention's route: P·V from the online accumulator, the P returned recomputed as exp(s − LSE).
    On large_logits in float64 the local check once took the returned P for the one used (ratio 4.48);
    the route allowance (model.local.weights_route) accepts it, measured from the adapter's own scores
    or, without them, from the golden's; the stale-accumulator bug still fails there, locally."""
    good = CORRECT["online_softmax_16_lse_weights"]
    bad, stage = BUGS["online_softmax_stale_accumulator"]
    if exposed == "without its scores":
        good, bad = _WithoutScores(good), _WithoutScores(bad)
    st = mhaspec.check(good, cases=["large_logits"], timeout=None, isolate=False).result(
        "large_logits", "float64").stage("head_outputs")
    assert st.verdict == PASS and st.local_worst_ratio is not None and st.local_worst_ratio <= 0.5, st
    for r in mhaspec.check(bad, cases=["tile_crossing"], timeout=None, isolate=False).results:
        st = r.stage(stage)
        assert r.first_failing_stage == stage and "local" in st.failed_check, (r.dtype, st)


# --- large fan-in: never a silent non-check -----------------------------------------------

def _big_case(fan_in: int = 2048) -> GoldenCase:
    """A user's own case with fan-in 2048 (d_model = H·D_k = 2048), golden computed with float64
    BLAS here (a test-local formulation: exactness is not what is tested)."""
    spec = CaseSpec(id="big_fan_in", config=MHAConfig(d_model=fan_in, num_heads=2), batch=1, tgt_len=3,
                    src_len=4, seed=11)
    cfg = spec.config
    inputs, weights = spec.make_inputs(), spec.make_weights()
    q = inputs["query"] @ weights["w_q"] + weights["b_q"]
    k = inputs["key"] @ weights["w_k"] + weights["b_k"]
    v = inputs["value"] @ weights["w_v"] + weights["b_v"]

    def heads(x):
        return x.reshape(1, -1, cfg.H, cfg.D_k).transpose(0, 2, 1, 3)

    s = cfg.scale * heads(q) @ np.swapaxes(heads(k), -1, -2)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    o = p @ heads(v)
    c = o.transpose(0, 2, 1, 3).reshape(1, 3, -1)
    y = c @ weights["w_o"] + weights["b_o"]
    stages = {"q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p, "head_outputs": o,
              "concat": c, "output": y}
    from pathlib import Path

    return GoldenCase(spec, inputs, weights, stages, np.ones(s.shape, dtype=bool), Path("<memory>"))


class _Returns:
    name = "returns"

    def __init__(self, value):
        self.value = value

    def run(self, case):
        return {"output": self.value}


@pytest.mark.parametrize("kind", ["zeros", "random", "golden"])
@pytest.mark.parametrize("precision", ["standard", "worst-case"])
def test_large_fan_in_bfloat16_never_passes_a_zero_or_random_output(kind, precision):
    import ml_dtypes

    golden = _big_case()
    y = golden.stages["output"]
    value = {
        "zeros": np.zeros_like(y),
        "random": np.random.default_rng(0).standard_normal(y.shape) * np.abs(y).max(),
        "golden": y,
    }[kind].astype(ml_dtypes.bfloat16)
    session = Session(_Returns(value), golden=golden_set_dummy(), precision=precision)
    stages = session.judge_stages(golden, "bfloat16", {"output": value})
    verdict = next(st for st in stages if st.stage == "output").verdict
    if precision == "standard":
        # fan-in 2048 with float32 accumulation is well resolved: right passes, wrong fails
        assert verdict == (PASS if kind == "golden" else FAIL), verdict
    else:
        # γ_bf16(2048) is infinite: the worst-case bound cannot judge — it says so, never passes
        assert verdict == UNINFORMATIVE, verdict


def golden_set_dummy():
    from mhaspec.fixtures import GoldenSet

    return GoldenSet()


def test_nothing_informative_is_not_a_conformance():
    from mhaspec.conformance import CaseResult, Report

    report = Report("x", None, None, "-", ["bfloat16"], [CaseResult("c", "bfloat16", UNINFORMATIVE)])
    assert not report.ok and report.exit_code == 2
    assert "NOTHING JUDGED" in report.summary()


# -- the fast evaluation of the bounds (issue 11): same bounds, less time ------------------------


def _random_rows(rng: np.random.Generator, rows: int, S: int, spread: float) -> np.ndarray:
    logits = rng.normal(scale=spread, size=(rows, S))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0])
def test_closed_form_second_order_never_undercuts_the_exact_one(spread):
    """The closed form is an upper bound of the exact pairwise term wherever it is used."""
    from mhaspec.conformance.model import softmax

    rng = np.random.default_rng(7)
    p = _random_rows(rng, 64, 37, spread)
    for top in (1e-6, 1e-4, 2.0**-10, 2.0**-6, 0.1):
        tau = rng.uniform(0, top, size=p.shape)
        ptau = p * tau
        ell = tau + ptau.sum(-1, keepdims=True) - 2 * ptau
        exact = np.maximum(softmax.softmax_worst(p, tau) - p * ell, 0.0)
        got = softmax.second_order(p, tau)
        # the exact term is float64 arithmetic on O(p) quantities: rounding of ~8 ulp of p
        assert np.all(got >= exact - 8 * 2.0**-53 * p), (spread, top)
        # and second order where the closed form is used: far below the first-order term's size
        if top <= softmax.SECOND_ORDER_CLOSED_FORM / 2:
            assert np.all(got <= p * (2 * top) ** 2 * 2), (spread, top)


def test_float32_products_round_up():
    from mhaspec.conformance.model.vocabulary import Pair, upper32

    rng = np.random.default_rng(3)
    a, b = rng.uniform(0, 1, (4, 50, 300)), rng.uniform(0, 1, (4, 300, 20)) ** 3
    assert np.all(upper32(a, Pair.of(b)) >= a @ b)
    huge = np.full((2, 3), 1e300)  # beyond float32: computed in float64 instead, never inf
    assert np.isfinite(upper32(huge, Pair.of(np.ones((3, 2))))).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_bounds_equal_whole_stage_bounds(dtype, monkeypatch):
    """The chunk size changes only the bounds' own float64 roundings (and the float32 products')."""
    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks
    from mhaspec.fixtures import GoldenSet

    golden = GoldenSet().load("causal_and_mask")
    whole = tol.golden_bounds(golden, dtype)
    own = {k: v.astype(np.float32).astype(np.float64) for k, v in golden.stages.items()}
    whole_local = tol.local_references(golden, own, dtype)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 7)  # one query row (or less) per chunk
    for name, bound in tol.golden_bounds(golden, dtype).items():
        np.testing.assert_allclose(bound.tolerance(8), whole[name].tolerance(8), rtol=1e-6, err_msg=name)
    for name, (ref, bound) in tol.local_references(golden, own, dtype).items():
        np.testing.assert_allclose(ref, whole_local[name][0], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(bound.tolerance(8), whole_local[name][1].tolerance(8), rtol=1e-6, err_msg=name)


def test_large_cases_get_a_timeout_scaled_by_their_size():
    from mhaspec.conformance.runner import TIMEOUT_WORK, case_timeout

    def case(T: int) -> CaseSpec:
        return CaseSpec(id="t", config=MHAConfig(d_model=512, num_heads=8), batch=1, tgt_len=T, src_len=T,
                        inputs="self", seed=1)

    assert 8 * 512 * 512 * 128 == TIMEOUT_WORK
    assert case_timeout(60.0, case(512)) == 60.0  # every committed case: as given
    assert all(case_timeout(60.0, c) == 60.0 for c in CATALOG)
    assert case_timeout(60.0, case(4096)) == 60.0 * 64
    assert case_timeout(None, case(4096)) is None and case_timeout(0.0, case(4096)) == 0.0


def _general_only(monkeypatch) -> None:
    """Every chunk through the model's general (np.where) rules: the in-place engine declines."""
    from mhaspec.conformance.engine import inplace

    for name in ("attention_chunk", "local_scores", "local_weights", "local_outputs"):
        monkeypatch.setattr(inplace, name, lambda *args, **kwargs: False)


def _assert_same_bounds(fast, general, rtol: float) -> None:
    golden_f, local_f = fast
    golden_g, local_g = general
    assert golden_f.keys() == golden_g.keys() and local_f.keys() == local_g.keys()
    for name in golden_g:
        for part in ("sigma", "worst"):
            np.testing.assert_allclose(getattr(golden_f[name], part), getattr(golden_g[name], part), rtol=rtol,
                                       atol=0, err_msg=f"golden {name} {part}")
    for name in local_g:
        (ref_f, b_f), (ref_g, b_g) = local_f[name], local_g[name]
        np.testing.assert_array_equal(np.isfinite(ref_f), np.isfinite(ref_g), err_msg=f"local {name}")
        np.testing.assert_allclose(ref_f, ref_g, rtol=rtol, atol=0, err_msg=f"local {name} reference")
        for part in ("sigma", "worst"):
            np.testing.assert_allclose(getattr(b_f, part), getattr(b_g, part), rtol=rtol, atol=0,
                                       err_msg=f"local {name} {part}")


def _own_with_special_values(golden: GoldenCase) -> dict[str, np.ndarray]:
    """An adapter's stages as many return them: float32-rounded, -inf at masked scores."""
    own = {k: v.astype(np.float32).astype(np.float64) for k, v in golden.stages.items()}
    own["scores"] = np.where(golden.visible, own["scores"], -np.inf)
    return own


@pytest.mark.parametrize("rows_per_chunk", ["whole", "one, on three threads"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_bounds_equal_the_general_ones_on_every_case(dtype, rows_per_chunk, monkeypatch):
    """The in-place engine of the chunk loops (engine.inplace) computes the model's general
    rules' bounds (model.forward.attention_chunk, model.local), to the rounding of the bounds' own
    arithmetic, on every catalog case (masks, blind rows, large logits, GQA) — in one chunk,
    and one query row a chunk on three threads (the general path: whole cases)."""
    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks
    from mhaspec.fixtures import GoldenSet

    golden_set = GoldenSet()
    fast = {}
    if rows_per_chunk != "whole":
        monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(chunks, "THREADED_MIN_CHUNKS", 2)
        monkeypatch.setattr(chunks, "threads", lambda: 3)
    for case_id in golden_set.ids():
        golden = golden_set.load(case_id)
        own = _own_with_special_values(golden)
        fast[case_id] = (tol.golden_bounds(golden, dtype), tol.local_references(golden, own, dtype))
    _general_only(monkeypatch)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1 << 30)
    for case_id in golden_set.ids():
        golden = golden_set.load(case_id)
        general = (tol.golden_bounds(golden, dtype), tol.local_references(golden, _own_with_special_values(golden), dtype))
        # other chunk shapes round the float32 products (model.vocabulary.upper32) otherwise, by <= γ₃₂(n)
        # ~ 1e-6, which the second-order term's cancellation (exact − p·ℓ) can amplify a few times
        _assert_same_bounds(fast[case_id], general, rtol=1e-9 if rows_per_chunk == "whole" else 1e-5)


def test_chunks_with_special_values_take_the_general_path(monkeypatch):
    """An adapter's NaN and inf in some chunks: those chunks' local bounds are the general
    functions' (NaN and inf where they put them), the other chunks' too, to rounding."""
    from mhaspec.conformance import tolerance as tol
    from mhaspec.fixtures import GoldenSet

    golden = GoldenSet().load("self_basic")
    own = _own_with_special_values(golden)
    own["scores"][0, 0, 1, 2] = np.nan
    own["attn_weights"][0, 1, 0, 0] = np.inf
    own["q_proj"][0, 2, 0] = np.inf
    fast = (tol.golden_bounds(golden, "float32"), tol.local_references(golden, own, "float32"))
    clean = tol.local_references(golden, _own_with_special_values(golden), "float32")
    assert not np.array_equal(fast[1]["attn_weights"][0][0, 0, 1], clean["attn_weights"][0][0, 0, 1])
    assert not np.isfinite(fast[1]["head_outputs"][0][0, 1, 0]).all()
    assert not np.isfinite(fast[1]["scores"][0]).all()
    _general_only(monkeypatch)
    _assert_same_bounds(fast, (tol.golden_bounds(golden, "float32"), tol.local_references(golden, own, "float32")),
                        rtol=1e-9)


def test_threaded_chunks_give_the_single_thread_bounds_bit_for_bit(monkeypatch):
    """A case large enough for the threaded chunk loop: the same bounds, bit for bit, on one
    thread and on several (the chunks write disjoint slices), and the general functions' to
    rounding."""
    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks
    from mhaspec.reference.onthefly import golden_case

    spec = CaseSpec(id="threads", config=MHAConfig(d_model=16, num_heads=2, causal=True), batch=1, tgt_len=300,
                    src_len=300, inputs="self", seed=3)
    golden = golden_case(spec)
    own = _own_with_special_values(golden)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 4096)  # 13 query rows a chunk
    assert len(chunks.chunks(2, 300, 300)) >= chunks.THREADED_MIN_CHUNKS
    monkeypatch.setattr(chunks, "threads", lambda: 3)
    threaded = (tol.golden_bounds(golden, "bfloat16"), tol.local_references(golden, own, "bfloat16"))
    monkeypatch.setattr(chunks, "threads", lambda: 1)
    single = (tol.golden_bounds(golden, "bfloat16"), tol.local_references(golden, own, "bfloat16"))
    _assert_same_bounds(threaded, single, rtol=0)
    _general_only(monkeypatch)
    _assert_same_bounds(threaded, (tol.golden_bounds(golden, "bfloat16"),
                                   tol.local_references(golden, own, "bfloat16")), rtol=1e-9)


def test_threaded_chunks_run_under_the_callers_floating_point_error_state(monkeypatch):
    """An adapter's NaN in a threaded case: the chunks run under the caller's floating-point error
    state (NumPy's is per thread), so the general path's NaN arithmetic raises no RuntimeWarning
    in a thread when the caller silenced it."""
    import warnings

    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks
    from mhaspec.reference.onthefly import golden_case

    spec = CaseSpec(id="threads", config=MHAConfig(d_model=16, num_heads=2, causal=True), batch=1, tgt_len=300,
                    src_len=300, inputs="self", seed=3)
    golden = golden_case(spec)
    own = _own_with_special_values(golden)
    own["scores"][0, 1, 250, 3] = np.nan
    own["attn_weights"][0, 0, 280, 9] = np.nan
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 4096)
    for threads in (1, 2):
        monkeypatch.setattr(chunks, "threads", lambda threads=threads: threads)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # in any thread: a warning there is an error
            refs = tol.local_references(golden, own, "float32")
        assert not np.isfinite(refs["attn_weights"][1].worst).all(), threads
        assert not np.isfinite(refs["head_outputs"][1].sigma).all() or \
            not np.isfinite(refs["head_outputs"][1].worst).all(), threads


@pytest.mark.parametrize("precision", ["standard", "worst-case"])
def test_tolerances_formed_in_the_chunks_are_those_of_the_bounds_bit_for_bit(precision, monkeypatch):
    """judging_bounds and stage_tolerances form the (B, H, T, S) stages' tolerances in the
    chunks; they are exactly LAMBDA·sigma + worst of golden_bounds, with the reference error
    where it is asked (an on-the-fly golden has one), in every dtype, also on several threads."""
    from mhaspec.conformance import tolerance as tol
    from mhaspec.conformance.engine import chunks
    from mhaspec.fixtures import GoldenSet
    from mhaspec.reference.onthefly import golden_case

    spec = CaseSpec(id="fused", config=MHAConfig(d_model=16, num_heads=2, causal=True), batch=2, tgt_len=80,
                    src_len=80, inputs="self", seed=4)
    goldens = [GoldenSet().load("self_basic"), GoldenSet().load("custom_mask"), golden_case(spec)]
    assert goldens[-1].reference_error is not None and isinstance(goldens[-1].reference_error["attn_weights"],
                                                                  np.ndarray)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1024)  # several chunks, on three threads
    monkeypatch.setattr(chunks, "THREADED_MIN_CHUNKS", 2)
    monkeypatch.setattr(chunks, "threads", lambda: 3)
    for golden in goldens:
        for dtype in DTYPES:
            bounds = tol.golden_bounds(golden, dtype, precision)
            expected = {k: b.tolerance(tol.LAMBDA) for k, b in judging.with_reference_error(golden, bounds).items()}
            raw, fused = tol.judging_bounds(golden, dtype, precision)
            plain = tol.stage_tolerances(golden, dtype, precision=precision)
            assert list(fused) == list(expected) == list(plain) == list(raw)
            for name in expected:
                np.testing.assert_array_equal(fused[name], expected[name], err_msg=f"{golden.spec.id} {dtype} {name}")
                np.testing.assert_array_equal(plain[name], bounds[name].tolerance(tol.LAMBDA))
                np.testing.assert_array_equal(raw[name].sigma, bounds[name].sigma)
                np.testing.assert_array_equal(raw[name].worst, bounds[name].worst)


def test_the_exact_softmax_bound_of_a_key_that_holds_its_row_is_not_lost_to_cancellation():
    """softmax_worst needs Σ_{k≠j} p_k e^{±τ_k} for every key j.  Formed as Σ_k − (the j-th term),
    it is the sum's rounding error where key j holds nearly all of its row (it came out 0 or a
    fraction of the true value: a tolerance up to 9x too tight on large_logits in bfloat16).  Each
    key's bound is compared with the one formed from the other keys' terms alone (math.fsum)."""
    import math

    from mhaspec.conformance.compare import Scratch
    from mhaspec.conformance.engine.inplace import exact_second_into
    from mhaspec.conformance.model.softmax import softmax_worst

    rng = np.random.default_rng(7)
    s = rng.normal(size=(6, 40))
    s[:, 3] += 35.0  # key 3 holds each row: the others' weights are ~1e-15
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    tau = rng.uniform(5.0, 25.0, size=p.shape)  # scores that may move a lot (float16/bfloat16, large logits)
    expected = np.zeros_like(p)
    for i in range(p.shape[0]):
        for j in range(p.shape[1]):
            up = math.fsum(p[i, k] * math.exp(tau[i, k]) for k in range(p.shape[1]) if k != j)
            down = math.fsum(p[i, k] * math.exp(-tau[i, k]) for k in range(p.shape[1]) if k != j)
            lo = p[i, j] / (p[i, j] + math.exp(tau[i, j]) * up)
            hi = p[i, j] / (p[i, j] + math.exp(-tau[i, j]) * down)
            expected[i, j] = min(max(hi - p[i, j], p[i, j] - lo), 1.0)
    got = softmax_worst(p, tau)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert (expected[:, 3] > 0.05).all()  # the dominant weight may fall a long way: the bound says so
    ell = np.zeros_like(p)
    fast = np.empty_like(p)
    exact_second_into(p, tau, ell, None, fast, Scratch())  # the in-place form (ℓ = 0: the bound itself)
    np.testing.assert_allclose(fast, expected, rtol=1e-12, atol=0)
