"""The same-precision second opinion (docs/tolerances.md, "The same-precision second opinion")."""

from __future__ import annotations

import math

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.conformance import FAIL, PASS
from mhaspec.conformance.blocks import judge_in_blocks
from mhaspec.conformance.compare import round_to_bfloat16
from mhaspec.conformance.runner import Session
from mhaspec.conformance.second_opinion import C, MIN_ELEMENTS, ORDERS, SecondOpinion, _bf16, _f16, plain_forward
from mhaspec.fixtures import GoldenSet
from mhaspec.protocol.contract import Deviation

from .variants import CORRECT, output_only


class _Scaled:
    """``case`` with its score scale multiplied by ``factor`` (everything else delegated)."""

    def __init__(self, case, factor):
        self._case = case
        self.config = case.config.model_copy(update={"scale": case.config.scale * factor})

    def __getattr__(self, name):
        return getattr(self._case, name)


class ScaleOff(NumpyMHA):
    """The numpy adapter with its scale off by ``rel`` relative: a bug too small for most elements'
    tolerance.  ``stages``: what it returns (default: only ``output``, as fused kernels do)."""

    name = "scale-off"

    def __init__(self, rel=1e-3, stages=("output",)):
        self.rel, self.stages = rel, tuple(stages)

    def run(self, case):
        out = self._forward(_Scaled(case, 1 + self.rel))[0]
        return {k: v for k, v in out.items() if k in self.stages}


@pytest.fixture(scope="module")
def golden():
    return GoldenSet()


def test_float16_rounding_by_bits_is_numpys():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-9, 6, 1 << 16),
                        [0.0, -0.0, 65504.0, 65519.9, 65520.0, 1e6, np.inf, -np.inf, 2.0**-14, 2.0**-25, 3 * 2.0**-25,
                         2.0**-14 - 2.0**-25]]).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(_f16(x), expected)


def test_bfloat16_rounding_matches_the_comparison_helper():
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3
    np.testing.assert_array_equal(_bf16(x).astype(np.float64), round_to_bfloat16(x))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_plain_orders_store_every_stage_in_the_dtype_and_differ_only_in_the_scores_path(golden, dtype):
    g = golden.load("large_logits")
    plain = dict(plain_forward(g, dtype))
    assert list(plain) == list(ORDERS)
    for order, stages in plain.items():
        for name, values in stages.items():
            assert values.shape == g.stages[name].shape, (order, name)
            if dtype in ("float16", "bfloat16"):
                stored = values.astype(np.float64)
                again = (stored.astype(np.float16).astype(np.float64) if dtype == "float16"
                         else round_to_bfloat16(stored))
                np.testing.assert_array_equal(again, stored, err_msg=f"{order} {name}")
    for name in ("q_proj", "k_proj", "v_proj"):  # the projections are shared by the orders that share them
        assert plain["log-sum-exp"][name] is plain["scale-after"][name]
        assert plain["query-prescaled"][name] is plain["sqrt-both"][name] is plain["scores-stored"][name]
    if dtype != "float64":  # the scale's rounding shows: the orders are different implementations
        assert not np.array_equal(plain["scale-after"]["scores"], plain["sqrt-both"]["scores"])


def test_the_rule_and_its_exact_merge():
    a = SecondOpinion(20, 2.0, {"x": 1.0, "y": 3.0}, 0.5)
    b = SecondOpinion(12, 30.0, {"x": 5.0, "y": 1.0}, 0.1)
    m = SecondOpinion.merged([a, b])
    assert (m.compared, m.adapter_ss, m.plain_ss, m.floor_ss) == (32, 32.0, {"x": 6.0, "y": 4.0}, 0.6)
    assert m.order == "x" and m.plain_rms == pytest.approx(math.sqrt(6 / 32))
    assert m.ratio == pytest.approx(math.sqrt(32 / 6)) and m.fails == (math.sqrt(32 / 6) > C)
    floor = SecondOpinion(20, 20 * 25.0, {"x": 0.0}, 20 * 4.0)  # e_min above the plain error: the reference
    assert floor.ratio == pytest.approx(2.5) and not floor.fails
    few = SecondOpinion(MIN_ELEMENTS - 1, 1e6, {"x": 1.0}, 0.0)
    assert few.ratio > C and not few.judged and not few.fails


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_correct_implementations_pass_it_with_margin(dtype):
    for adapter in (NumpyMHA(), CORRECT["einsum"], CORRECT["prescaled_query"],
                    output_only(CORRECT["tiled_online_softmax"])):
        report = mhaspec.check(adapter, dtypes=[dtype], isolate=False, timeout=None)
        ratios = [st.second_opinion.ratio for r in report.results for st in r.stages
                  if st.second_opinion is not None and st.second_opinion.judged]
        assert ratios and max(ratios) <= C / 2, (adapter, dtype, max(ratios))
        assert not [r for r in report.results if r.verdict == FAIL]


def test_the_scale_orders_are_what_let_a_prescaled_query_pass_large_logits(golden):
    """On large_logits (|scores| in the hundreds, exact projections) where the scale is rounded is
    most of a float32 implementation's error: judged against the spec's order alone, a correct
    pre-scaled query would be several times the plain error."""
    report = mhaspec.check(CORRECT["prescaled_query"], dtypes=["float32"], cases=["large_logits"], isolate=False)
    so = report.results[0].stage("attn_weights").second_opinion
    alone = math.sqrt(so.plain_ss["scale-after"] / so.compared)
    assert so.order in ("query-prescaled", "sqrt-both") and so.ratio <= C
    assert so.adapter_rms / max(alone, so.floor_rms) > so.ratio


@pytest.mark.parametrize("rel", [1e-3, 1e-4])
def test_a_scale_off_by_a_little_fails_the_second_opinion_alone(rel):
    report = mhaspec.check(ScaleOff(rel), dtypes=["float32"], cases=["long_sequence"], isolate=False)
    out = report.results[0].stage("output")
    assert out.verdict == FAIL and "second_opinion" in out.failed_check, out.message
    assert out.second_opinion.ratio > 10 * C
    assert "second opinion" in out.message


def test_off_under_the_worst_case_contract_and_none_for_what_is_not_returned():
    report = mhaspec.check(ScaleOff(1e-4), dtypes=["float32"], cases=["long_sequence"], isolate=False,
                           precision="worst-case")
    assert all(st.second_opinion is None for st in report.results[0].stages)
    report = mhaspec.check(ScaleOff(1e-4), dtypes=["float32"], cases=["long_sequence"], isolate=False)
    assert report.results[0].stage("scores").second_opinion is None


def test_a_declared_deviation_excuses_it():
    class Declared(ScaleOff):
        known_deviations = [Deviation("a scale of our own", case="long_sequence", dtype="float32", stage="output")]

    report = mhaspec.check(Declared(1e-4), dtypes=["float32"], cases=["long_sequence"], isolate=False)
    so = report.results[0].stage("output").second_opinion
    assert so.ratio > C and not so.applies and so.excused
    assert "second_opinion" not in report.results[0].stage("output").failed_check


def test_the_verdict_does_not_depend_on_the_block_size(golden):
    g = golden.load("long_sequence")
    with Session(ScaleOff(1e-4, stages=("scores", "attn_weights", "output")), isolate=False) as session:
        returned = session._worker.run(g.case("float32"), None)[0]
        whole = judge_in_blocks(g, returned, lambda b, r: session.judge_stages(b, "float32", r))
        blocked = judge_in_blocks(g, returned, lambda b, r: session.judge_stages(b, "float32", r),
                                  max_elements=2 * 128 * 7)  # blocks of 7 query rows
    assert len({len(whole), len(blocked)}) == 1
    for a, b in zip(whole, blocked):
        if a.second_opinion is None:
            assert b.second_opinion is None
            continue
        assert b.second_opinion.compared == a.second_opinion.compared
        assert (b.second_opinion.ratio > C) == (a.second_opinion.ratio > C)
        # the blocks' sums merge exactly (test_blocks_merge_the_sums_of_squares_exactly); the plain
        # float32 products may round differently with the block's row count where the BLAS picks its
        # kernel by matrix size (OpenBLAS on AVX-512: ratios 1078/1091, 502/496, 286/304 whole/blocked;
        # on AVX2 equal to 9 digits), far less than the factor C between a pass and a failure
        assert b.second_opinion.ratio == pytest.approx(a.second_opinion.ratio, rel=0.25)


@pytest.mark.parametrize("rel", [0.0, 1e-4])
def test_a_causal_case_in_blocks_attends_the_plain_orders_to_the_keys_its_rows_see(rel, monkeypatch):
    """A block of query rows of a causal case: the plain implementations stop at the block's last
    seen key (every weight beyond is 0, no score beyond compared): the same compared elements, the
    same verdict, the plain errors of other float32 sums only (a few % here, as another block height's)."""
    from mhaspec.conformance import second_opinion
    from mhaspec.reference.onthefly import OnTheFlyGolden, golden_case
    from mhaspec.spec import Catalog, CaseSpec, MHAConfig

    spec = CaseSpec(id="so_causal", config=MHAConfig(d_model=32, num_heads=4, causal=True),
                    batch=1, tgt_len=256, src_len=256, inputs="self", seed=3)
    g = golden_case(spec)
    keys: list[int | None] = []
    real = second_opinion.plain_forward

    def told(*args, **kwargs):
        keys.append(kwargs.get("keys"))
        return real(*args, **kwargs)

    monkeypatch.setattr(second_opinion, "plain_forward", told)
    adapter = ScaleOff(rel, stages=("scores", "attn_weights", "head_outputs", "output"))
    with Session(adapter, golden=OnTheFlyGolden(Catalog([spec])), isolate=False) as session:
        returned = session._worker.run(g.case("float32"), None)[0]
        whole = judge_in_blocks(g, returned, lambda b, r: session.judge_stages(b, "float32", r))
        assert keys == [256]
        blocked = judge_in_blocks(g, returned, lambda b, r: session.judge_stages(b, "float32", r),
                                  max_elements=4 * 256 * 32)  # blocks of 32 query rows
    assert keys[1:] == list(range(32, 257, 32))
    for a, b in zip(whole, blocked):
        assert a.stage == b.stage and (a.second_opinion is None) == (b.second_opinion is None)
        if a.second_opinion is None:
            continue
        assert b.second_opinion.compared == a.second_opinion.compared, a.stage
        assert b.second_opinion.adapter_rms == pytest.approx(a.second_opinion.adapter_rms, rel=1e-12), a.stage
        assert (b.second_opinion.ratio > C) == (a.second_opinion.ratio > C), a.stage
        assert b.second_opinion.ratio == pytest.approx(a.second_opinion.ratio, rel=0.25), a.stage


def test_blocks_merge_the_sums_of_squares_exactly():
    """SecondOpinion.merged adds the blocks' sums and counts: the merged ratio is the one computed
    from the whole's sums (float sums of the same terms, to rounding)."""
    from mhaspec.conformance.second_opinion import SecondOpinion

    rng = np.random.default_rng(3)
    adapter, plain_a, plain_b, floor = (rng.normal(size=400) ** 2 * 1e-12 for _ in range(4))
    cuts = [0, 7, 150, 151, 400]
    parts = [SecondOpinion(b - a, float(adapter[a:b].sum()), {"x": float(plain_a[a:b].sum()),
                           "y": float(plain_b[a:b].sum())}, float(floor[a:b].sum()), dtype="float32")
             for a, b in zip(cuts, cuts[1:])]
    whole = SecondOpinion(400, float(adapter.sum()), {"x": float(plain_a.sum()), "y": float(plain_b.sum())},
                          float(floor.sum()), dtype="float32")
    merged = SecondOpinion.merged(parts)
    assert merged.compared == 400 and merged.order == whole.order
    assert merged.ratio == pytest.approx(whole.ratio, rel=1e-12)


def test_the_json_report_carries_it(golden):
    report = mhaspec.check(NumpyMHA(), dtypes=["float32"], cases=["gqa"], isolate=False)
    st = report.results[0].stage("output").to_json()["second_opinion"]
    assert st["C"] == C and st["order"] in ORDERS and st["applies"] is True and st["excused"] is None
    assert 0 < st["ratio"] <= C and st["compared"] == report.results[0].stage("output").compared
    assert report.results[0].verdict == PASS


def test_a_row_scoped_declaration_leaves_out_only_the_rows_that_see_no_key(golden):
    class RowScoped(ScaleOff):
        known_deviations = [Deviation("uniform weights where a row sees no key", rows="fully_masked", stage="output")]

    report = mhaspec.check(RowScoped(1e-4), dtypes=["float32"], cases=["long_sequence", "self_masked_rows"],
                           isolate=False)
    plain = report.result("long_sequence", "float32").stage("output")  # no such rows: it does not apply
    assert plain.second_opinion.applies and "second_opinion" in plain.failed_check
    masked = report.result("self_masked_rows", "float32").stage("output")
    g = golden.load("self_masked_rows")
    outside = np.broadcast_to(~(~g.visible.any(axis=-1)).any(axis=1)[..., None], g.stages["output"].shape)
    assert 0 < masked.second_opinion.compared == int(np.count_nonzero(outside)) < outside.size
    assert masked.second_opinion.applies


def test_the_selection_leaves_out_nonfinite_elements_only_where_there_are_some():
    """:func:`second_opinion._finite_selection`: the compared elements where the value and the golden are
    both finite, the golden gathered by them and Σ (value − golden)² over them — as the isfinite passes
    define them, whether or not the first sum (over the whole selection) was finite."""
    from mhaspec.conformance.second_opinion import _finite_selection

    rng = np.random.default_rng(21)
    g = rng.normal(size=(2, 3, 40))
    base = np.broadcast_to(rng.random((1, 3, 40)) < 0.7, g.shape)
    for bad in (None, np.nan, np.inf, -np.inf):
        got = g + rng.normal(scale=1e-3, size=g.shape)
        if bad is not None:
            got[1, 2, 5] = bad
            got[0, 0, 0] = bad  # one outside the selection, perhaps
        for sel in (None, base):
            finite = np.isfinite(got) & np.isfinite(g)
            want = finite if sel is None else sel & finite
            chosen, g_sel, ss = _finite_selection(got, g, sel)
            if want.all():
                assert chosen is None and g_sel is g
            else:
                assert chosen is not None and chosen.flags.c_contiguous and np.array_equal(chosen, want)
                assert np.array_equal(g_sel, g[want])
            assert ss == pytest.approx(float(np.sum((got[want] - g[want]) ** 2)), rel=1e-12)
            assert math.isfinite(ss)
