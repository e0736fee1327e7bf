"""The fast reference: its error bound holds against the exact reference, and
``mhaspec run --catalog`` judges on the fly through the same Session."""

from __future__ import annotations

import json
from decimal import Context, Decimal

import numpy as np
import pytest

from mhaspec.cli import main
from mhaspec.fixtures import GoldenSet
from mhaspec.reference import forward
from mhaspec.reference.fast import EXP_ULPS, exact_product, forward_fast, grid_exponent
from mhaspec.reference.onthefly import OnTheFlyGolden
from mhaspec.spec.stages import forward_stages
from mhaspec.spec import CATALOG, STAGES, MHAConfig

from .variants import BUGS


def _within(fast, exact: dict[str, np.ndarray]) -> dict[str, float]:
    """Worst |fast - exact| / bound per stage (asserting <= 1 everywhere)."""
    ratios = {}
    for stage in STAGES:
        err = np.abs(fast.stages[stage] - exact[stage])
        bound = np.broadcast_to(fast.error[stage], err.shape)
        assert np.all(err <= bound), f"{stage}: error {np.max(err - bound):.3g} above its bound"
        ratios[stage] = float(np.max(np.where(bound > 0, err / np.where(bound > 0, bound, 1), 0)))
    return ratios


def test_fast_reference_is_within_its_bound_on_every_committed_case():
    """Every stage of every fixture, the variants' included; a spec-1.1 fixture's lse (computed at
    load) against the exact reference's."""
    from mhaspec.reference.variants import lse

    for golden in GoldenSet():
        fast = forward_fast(golden.spec.config, golden.inputs, golden.weights, golden.spec.seq_lens)
        variant = golden.spec.config.has_variants or golden.spec.bias is not None
        exact = {s: golden.stages[s] for s in forward_stages(golden.spec.config)} if variant else {
            **{s: golden.stages[s] for s in STAGES}, "lse": lse(golden.stages["scores"], golden.visible, None)}
        _within_all(fast, exact, golden.visible)
        assert np.array_equal(fast.visible, golden.visible)
        # dyadic inputs: projections and scores are proven exact, hence bit-identical to the fixtures
        # (the scores unless RoPE, softcap, a bias or ALiBi round them further)
        rounded = (golden.spec.config.rope, golden.spec.config.softcap, golden.spec.config.alibi_slopes,
                   golden.spec.bias) != (None, None, None, None)
        for stage in ("q_proj", "k_proj", "v_proj") + (() if rounded else ("scores",)):
            assert fast.exact[stage] and fast.error[stage] == 0.0, (golden.id, stage)
            assert np.array_equal(fast.stages[stage], golden.stages[stage]), (golden.id, stage)


def test_fast_reference_bound_holds_on_data_that_is_not_exact():
    """Non-dyadic float64 data: every exactness proof fails, every bound is the general one."""
    rng = np.random.default_rng(3)
    cfg = MHAConfig(d_model=24, num_heads=4, num_kv_heads=2, head_dim=8, value_head_dim=5, out_dim=7,
                    causal=True, causal_alignment="bottom_right")
    B, T, S = 2, 9, 13
    inputs = {"query": 3 * rng.standard_normal((B, T, 24)), "key": rng.standard_normal((B, S, 24)),
              "value": rng.standard_normal((B, S, 24)), "mask": rng.random((B, 1, T, S)) < 0.8}
    weights = {n: rng.standard_normal(s) for n, s in cfg.weight_shapes().items()}
    fast = forward_fast(cfg, inputs, weights)
    assert not any(fast.exact.values())
    ratios = _within(fast, forward(cfg, inputs, weights))
    assert all(0 < r <= 1 for r in ratios.values())  # every bound is exercised, none is violated


def test_fast_reference_probabilistic_bound_holds_on_long_sums():
    """Sums longer than 64 terms (projections over d_model = 160, softmax and P·V over S = 150) take the
    probabilistic LAMBDA·√n·u bound, smaller than γ(n): it holds on non-dyadic data against the exact
    reference, and the fast reference's LAMBDA is the tolerance model's."""
    from mhaspec.conformance.model.vocabulary import LAMBDA
    from mhaspec.reference import fast

    assert fast.LAMBDA == LAMBDA
    assert fast.sum_bound(60) == fast.gamma(60) and fast.sum_bound(162) < fast.gamma(162)
    rng = np.random.default_rng(5)
    cfg = MHAConfig(d_model=160, num_heads=2, causal=True)
    B, T, S = 1, 12, 150
    inputs = {"query": rng.standard_normal((B, T, 160)), "key": rng.standard_normal((B, S, 160)),
              "value": rng.standard_normal((B, S, 160)), "mask": None}
    weights = {n: rng.standard_normal(s) / np.sqrt(160) for n, s in cfg.weight_shapes().items()}
    f = forward_fast(cfg, inputs, weights)
    assert not any(f.exact.values())
    ratios = _within(f, forward(cfg, inputs, weights))
    assert all(0 < r <= 1 for r in ratios.values())


def test_exactness_proof():
    a = np.array([[3.0, -5.0]]) * 2.0**-5
    assert grid_exponent(a) == -5 and grid_exponent(np.zeros(3)) is None
    assert grid_exponent(np.array([0.75])) == -2
    assert exact_product(a, np.array([[1.0], [0.5]])) == (True, -6)
    big = np.array([[2.0**27 + 1, 2.0**27 + 1]])  # products need 55 bits: not provably exact
    assert not exact_product(big, big.T)[0]


def test_numpy_exp_is_within_the_assumed_ulps():
    """The bound assumes numpy's exp within EXP_ULPS ulps of the correctly rounded exp."""
    rng = np.random.default_rng(7)
    x = np.concatenate([-rng.exponential(3.0, 3000), -rng.uniform(0, 700, 1000), -rng.uniform(0, 1e-3, 1000)])
    context = Context(prec=40)
    exact = np.array([float(Decimal(v).exp(context)) for v in x.tolist()])
    assert np.max(np.abs(np.exp(x) - exact) / np.spacing(exact)) <= EXP_ULPS


def _catalog(tmp_path, cases) -> str:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(cases))
    return str(path)


CASES = [
    {"id": "odd_sizes", "config": {"d_model": 24, "num_heads": 6, "num_kv_heads": 2, "causal": True,
                                   "causal_alignment": "bottom_right"},
     "batch": 2, "tgt_len": 33, "src_len": 70, "seed": 5},
    {"id": "memory", "config": {"d_model": 16, "num_heads": 2, "kdim": 12, "vdim": 12},
     "batch": 1, "tgt_len": 9, "src_len": 65, "inputs": "shared_kv", "seed": 6,
     "mask": {"kind": "random", "density": 0.5, "fully_masked": [[0, 3]]}},
]


def test_run_catalog_judges_on_the_fly_without_writing(tmp_path, capsys):
    catalog = _catalog(tmp_path, CASES)
    assert main(["run", "numpy", "--catalog", catalog]) == 0
    out = capsys.readouterr().out
    assert "odd_sizes" in out and "memory" in out and "CONFORMS" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]  # no fixture written


def test_run_catalog_finds_bugs_at_their_stage(tmp_path):
    import mhaspec

    golden = OnTheFlyGolden(_catalog(tmp_path, CASES[:1]))
    for bug in ("gqa_heads_by_modulo", "causal_wrong_alignment", "missing_scale"):
        adapter, stage = BUGS[bug]
        report = mhaspec.check(adapter, dtypes=["float32"], golden=golden, timeout=None)
        assert [r.first_failing_stage for r in report.results] == [stage], bug


def test_run_catalog_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = _catalog(tmp_path, [{**CASES[0], "config": {"d_model": 10, "num_heads": 3}}])
    assert main(["run", "numpy", "--catalog", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "case 0 (odd_sizes)" in err and "cases.0.config" in err and "not divisible" in err
    assert main(["run", "numpy", "--catalog", bad, "--golden", str(tmp_path)]) == 2
    assert main(["run", "numpy", "--catalog", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_run_catalog_says_what_it_does_not_judge(tmp_path):
    """A user's --catalog has no backward golden: --backward says its backward stages were not
    judged (one warning, not silence). An adapter's deviations that name built-in catalog cases
    are not reported as matching nothing; a name that is in neither still is."""
    import mhaspec
    from mhaspec.adapters import Deviation

    from .variants import Variant

    golden = OnTheFlyGolden(_catalog(tmp_path, CASES[:1]))
    report = mhaspec.check("numpy", dtypes=["float32"], golden=golden, timeout=None, backward=True)
    assert report.ok
    assert [w for w in report.warnings if "no backward golden" in w] == [
        "--backward: 1 case×dtype have no backward golden (the cases of --catalog are computed on the fly, "
        "forward only: docs/backward.md); their backward stages were not judged"]
    assert {s.stage for r in report.results for s in r.stages} <= set(forward_stages(golden.load(CASES[0]["id"]).spec.config))

    class Declared(Variant):
        known_deviations = [Deviation("built-in case", case="custom_mask", stage="output"),
                            Deviation("typo", case="custom_msak", stage="output")]

    report = mhaspec.check(Declared(name="declared"), dtypes=["float32"], golden=golden, timeout=None)
    assert [w for w in report.warnings if "matches no case" in w] == [
        "known deviation custom_msak/*/output matches no case in the golden folder or the catalog"]


def test_fast_rows_are_bit_identical_to_the_rows_of_the_whole_case():
    """FastRows.rows(b, t0, t1) (a block starting at a multiple of FAST_ROWS, any end) gives exactly
    those rows of the whole case, stages and error bounds, on exact and on non-exact data."""
    from mhaspec.reference.fast import FAST_ROWS, FastRows

    rng = np.random.default_rng(7)
    cfg = MHAConfig(d_model=24, num_heads=4, num_kv_heads=2, head_dim=8, causal=True)
    B, T, S = 2, 2 * FAST_ROWS + 9, 50
    inputs = {"query": rng.standard_normal((B, T, 24)), "key": rng.standard_normal((B, S, 24)),
              "value": rng.standard_normal((B, S, 24)), "mask": rng.random((B, 1, T, S)) < 0.8}
    weights = {n: rng.standard_normal(s) for n, s in cfg.weight_shapes().items()}
    dyadic = {k: None if v is None else np.round(v * 8) / 8 if v.dtype != bool else v for k, v in inputs.items()}
    for data, exact in ((inputs, False), (dyadic, True)):
        fast = FastRows(cfg, data, {k: np.round(v * 8) / 8 for k, v in weights.items()} if exact else weights)
        whole = fast.whole()
        assert whole.exact["scores"] is exact
        for b in range(B):
            for t0, t1 in ((0, FAST_ROWS), (FAST_ROWS, T), (2 * FAST_ROWS, T), (0, T)):
                rows = fast.rows(b, t0, t1)
                for stage in STAGES:
                    for got, want in ((rows.stages[stage], whole.stages[stage]), (rows.error[stage], whole.error[stage])):
                        if isinstance(want, float):
                            assert got == want
                            continue
                        part = want[b : b + 1] if stage in ("k_proj", "v_proj") else (
                            want[b : b + 1, :, t0:t1] if want.ndim == 4 else want[b : b + 1, t0:t1])
                        assert np.array_equal(got, part), (exact, b, t0, t1, stage)
        with pytest.raises(ValueError, match="multiple"):
            fast.rows(0, 1, T)


def test_a_case_made_one_block_at_a_time_is_judged_as_the_whole_case(monkeypatch):
    """OnTheFlyGolden makes a large case a RowBlocks (threshold lowered here): the golden blocks are
    computed as the judge asks and the verdicts and figures are those of the whole golden judged in
    the same blocks, for a correct adapter and a buggy one."""
    import mhaspec
    from mhaspec.conformance import blocks
    from mhaspec.fixtures import RowBlocks
    from mhaspec.reference import fast, onthefly
    from mhaspec.spec import Catalog, CaseSpec

    spec = CaseSpec(id="rows", config=MHAConfig(d_model=16, num_heads=2, causal=True), batch=2,
                    tgt_len=100, src_len=100, inputs="self", seed=2)
    catalog = Catalog([spec])
    rows = 40  # blocks of 40 rows: 2 * 40 * 100 elements per block

    def figures(adapter, golden):
        report = mhaspec.check(adapter, ["float32"], golden=golden, isolate=False)
        return [(s.stage, s.verdict, s.worst_ratio, s.worst_index, s.local_worst_ratio, s.compared)
                for s in report.results[0].stages]

    monkeypatch.setattr(onthefly, "ROW_BLOCKS_ABOVE", 0)
    monkeypatch.setattr(onthefly, "ROW_BLOCK_ELEMENTS", 2 * rows * 100)
    monkeypatch.setattr(onthefly, "FAST_ROWS", 8)
    monkeypatch.setattr(fast, "FAST_ROWS", 8)  # (both references below: the same sub-blocks)
    lazy = onthefly.OnTheFlyGolden(catalog)
    assert isinstance(lazy.load("rows"), RowBlocks) and lazy.load("rows").block_rows == rows
    bug, _ = BUGS["missing_scale"]
    got = {name: figures(adapter, lazy) for name, adapter in (("numpy", "numpy"), ("bug", bug))}
    monkeypatch.setattr(onthefly, "ROW_BLOCKS_ABOVE", 1 << 40)
    monkeypatch.setattr(blocks, "MAX_BLOCK_ELEMENTS", 2 * rows * 100)
    whole = onthefly.OnTheFlyGolden(catalog)
    assert not isinstance(whole.load("rows"), RowBlocks)
    want = {name: figures(adapter, whole) for name, adapter in (("numpy", "numpy"), ("bug", bug))}
    assert got == want
    assert {v for _, v, *_ in got["numpy"]} == {"pass"} and "fail" in {v for _, v, *_ in got["bug"]}


def test_a_case_made_one_block_at_a_time_with_a_misshapen_stage_is_judged_whole(monkeypatch):
    """A returned stage of the wrong shape: the RowBlocks case is judged whole (its stages then
    computed whole), and the stage fails with the shapes in its message."""
    import mhaspec
    from mhaspec.adapters.numpy_mha import NumpyMHA
    from mhaspec.fixtures import RowBlocks
    from mhaspec.reference import onthefly
    from mhaspec.spec import Catalog, CaseSpec

    class Misshapen(NumpyMHA):
        name = "misshapen"

        def run(self, case):
            out = super().run(case)
            out["scores"] = out["scores"][..., :-1]
            return out

    monkeypatch.setattr(onthefly, "ROW_BLOCKS_ABOVE", 0)
    spec = CaseSpec(id="rows", config=MHAConfig(d_model=16, num_heads=2, causal=True), batch=1,
                    tgt_len=70, src_len=70, inputs="self", seed=2)
    golden = onthefly.OnTheFlyGolden(Catalog([spec]))
    assert isinstance(golden.load("rows"), RowBlocks)
    result = mhaspec.check(Misshapen(), ["float32"], golden=golden, isolate=False).results[0]
    scores = next(s for s in result.stages if s.stage == "scores")
    assert result.verdict == "fail" and scores.verdict == "fail" and "shape" in scores.message
    assert {s.verdict for s in result.stages if s.stage != "scores"} == {"pass"}


# -- the attention variants (docs/spec.md §2a) and lse ---------------------------------------------------

def _within_all(fast, exact: dict[str, np.ndarray], visible: np.ndarray) -> dict[str, float]:
    """Worst |fast - exact| / bound of every forward stage the case has (variant stages included; the
    masked scores excluded, as the judge does; equal infinities, the lse of a row that sees no key, agree)."""
    ratios = {}
    for stage in exact:
        got, want = fast.stages[stage], exact[stage]
        with np.errstate(invalid="ignore"):  # −inf − −inf: equal, the where takes 0
            err = np.where(got == want, 0.0, np.abs(got - want))
        bound = np.broadcast_to(fast.error[stage], err.shape)
        where = visible if stage == "scores" else np.ones(err.shape, dtype=bool)
        assert np.all((err <= bound) | ~where), f"{stage}: error {np.max(np.where(where, err - bound, -1)):.3g} above its bound"
        ratios[stage] = float(np.max(np.where(where & (bound > 0), err / np.where(bound > 0, bound, 1), 0)))
    return ratios


VARIANT_CONFIGS = [
    {"window_left": 1, "window_right": 0},
    {"window_left": 2, "window_right": 1, "causal": True, "causal_alignment": "bottom_right"},
    {"softcap": 0.5},
    {"alibi_slopes": "standard", "causal": True},
    {"alibi_slopes": [0.5, 0.3], "causal_alignment": "bottom_right", "window_right": 1},
    {"sinks": True},
    {"sinks": True, "window_left": 0, "causal": True},
    {"rope": {"style": "half"}},
    {"rope": {"style": "interleaved", "rotary_dim": 2, "query_offset": 7, "key_offset": 3}, "num_kv_heads": 1},
    {"rope": {"theta": 500.0}, "softcap": 1.0, "alibi_slopes": "standard", "sinks": True, "window_left": 2},
]


@pytest.mark.parametrize("config", VARIANT_CONFIGS)
@pytest.mark.parametrize("bias", [None, {"per_head": True, "per_batch": True}])
def test_the_fast_reference_of_every_variant_is_within_its_bound(config, bias):
    """Each variant stage by stage (q_rot, k_rot, scores after softcap / bias / ALiBi, lse, the
    weights with sinks, …) against the exact reference, on dyadic catalog data and on non-dyadic data
    (T > S bottom-right too, where rows see no key), and every bound is finite where data is finite."""
    from mhaspec.spec import CaseSpec
    from mhaspec.spec.stages import forward_stages

    spec = CaseSpec(id="v", config=MHAConfig(d_model=8, num_heads=2, **config), batch=2, tgt_len=5, src_len=7,
                    seed=len(str(config)), bias=bias)
    inputs, weights = spec.make_inputs(), spec.make_weights()
    rng = np.random.default_rng(11)
    noisy_inputs = {k: v + rng.standard_normal(v.shape) * 2**-9 for k, v in inputs.items() if k != "mask"}
    noisy_weights = {k: v * (1 + rng.standard_normal(v.shape) * 2**-7) for k, v in weights.items()}
    for x, w in ((inputs, weights), (noisy_inputs, noisy_weights)):
        fast, exact = forward_fast(spec.config, x, w), forward(spec.config, x, w)
        assert list(fast.stages) == list(forward_stages(spec.config)) and set(exact) == set(fast.stages)
        ratios = _within_all(fast, exact, fast.visible)
        assert all(np.all(np.isfinite(np.asarray(fast.error[s]))) for s in fast.error), ratios
        assert ratios["lse"] > 0  # the lse bound is exercised, never violated
        if spec.config.rope is not None:
            assert ratios["q_rot"] > 0 and ratios["k_rot"] > 0
    # T > S bottom-right: the first rows see no key; lse is −inf there in both, its bound 0
    wide = spec.model_copy(update={"tgt_len": 9, "src_len": 4, "bias": None,
                                   "config": spec.config.model_copy(update={"causal_alignment": "bottom_right"})})
    if wide.config.window_left is not None or wide.config.causal:
        x, w = wide.make_inputs(), wide.make_weights()
        fast, exact = forward_fast(wide.config, x, w), forward(wide.config, x, w)
        _within_all(fast, exact, fast.visible)
        empty = ~fast.visible.any(axis=-1)
        assert np.all(np.isneginf(fast.stages["lse"][empty])) and np.all(np.asarray(fast.error["lse"])[empty] == 0)


@pytest.mark.parametrize("config", [VARIANT_CONFIGS[1], VARIANT_CONFIGS[8], VARIANT_CONFIGS[9]])
def test_fast_rows_of_a_variant_case_are_bit_identical_to_the_rows_of_the_whole_case(config, monkeypatch):
    """RoPE positions, ALiBi distances, windows and the bias are taken by case row: a block of rows
    (FastRows.rows) gives exactly those rows of the whole case, stages (q_rot, k_rot, lse too) and bounds."""
    from mhaspec.reference import fast as fast_module
    from mhaspec.spec import CaseSpec

    monkeypatch.setattr(fast_module, "FAST_ROWS", 4)
    spec = CaseSpec(id="v", config=MHAConfig(d_model=8, num_heads=2, **config), batch=2, tgt_len=11, src_len=9,
                    seed=4, bias={"per_head": True, "per_batch": False})
    fast = fast_module.FastRows(spec.config, spec.make_inputs(), spec.make_weights())
    whole = fast.whole()
    for b in range(2):
        for t0, t1 in ((0, 4), (4, 11), (8, 11)):
            rows = fast.rows(b, t0, t1)
            assert list(rows.stages) == list(whole.stages)
            for stage in whole.stages:
                for got, want in ((rows.stages[stage], whole.stages[stage]), (rows.error[stage], whole.error[stage])):
                    if isinstance(want, float):
                        assert got == want
                        continue
                    if stage in ("k_proj", "v_proj", "k_rot"):
                        part = want[b : b + 1]
                    elif want.ndim == 4 or stage == "lse":
                        part = want[b : b + 1, :, t0:t1]
                    else:
                        part = want[b : b + 1, t0:t1]
                    assert np.array_equal(got, part), (b, t0, t1, stage)


def test_a_spec_1_1_fixture_gets_its_lse_at_load_within_its_bound():
    """A fixture without lse (every spec-1.1 one, byte-identical) gets it computed at load from its exact
    scores, with its bound in reference_error (which names only lse: the other stages are exact)."""
    from mhaspec.reference.variants import lse

    plain = 0
    for golden in GoldenSet():
        if golden.spec.config.has_variants or golden.spec.bias is not None:
            assert golden.reference_error is None and "lse" in golden.stages  # stored exactly
            continue
        plain += 1
        assert set(golden.reference_error) == {"lse"} and golden.reference_error["scores"] == 0.0
        exact = lse(golden.stages["scores"], golden.visible, None)
        with np.errstate(invalid="ignore"):  # −inf − −inf: equal, the where takes 0
            err = np.where(golden.stages["lse"] == exact, 0.0, np.abs(golden.stages["lse"] - exact))
        assert np.all(err <= golden.reference_error["lse"]), golden.id
    served = sum(1 for c in CATALOG if (c.schedule is not None or c.seq_lens is not None) and not c.config.has_variants
                 and c.bias is None)
    assert plain == 28 + served and served > 0  # the spec-1.1 cases, the schedule and packed cases without variants


def test_numpy_elementary_functions_are_within_the_assumed_ulps():
    """The variants' bounds assume numpy's tanh, cos, sin, log and power within ELEMENTARY_ULPS ulps of the
    correctly rounded value (compared with mpmath at 60 digits; cos and sin up to angles of 10^4, as
    RoPE's positions with offsets give)."""
    mpmath = pytest.importorskip("mpmath")
    from mhaspec.reference.fast import ELEMENTARY_ULPS

    mpmath.mp.prec = 200
    rng = np.random.default_rng(13)
    small = np.concatenate([rng.uniform(-20, 20, 400), rng.uniform(-1e-3, 1e-3, 100)])
    angles = np.concatenate([rng.uniform(-4, 4, 300), rng.uniform(0, 1e4, 300)])
    positive = np.concatenate([rng.uniform(1, 3000, 300), rng.uniform(1e-3, 1, 100)])
    exponents = -rng.uniform(0, 1, 200)
    checks = {
        "tanh": (np.tanh(small), [mpmath.tanh(v) for v in small.tolist()]),
        "cos": (np.cos(angles), [mpmath.cos(v) for v in angles.tolist()]),
        "sin": (np.sin(angles), [mpmath.sin(v) for v in angles.tolist()]),
        "log": (np.log(positive), [mpmath.log(v) for v in positive.tolist()]),
        "power": (500000.0 ** exponents, [mpmath.power(500000, v) for v in exponents.tolist()]),
    }
    for name, (got, want) in checks.items():
        rounded = np.array([float(v) for v in want])
        ulps = np.abs(got - rounded) / np.spacing(np.abs(rounded))
        assert np.max(ulps) <= ELEMENTARY_ULPS, (name, np.max(ulps))


def test_a_block_of_a_spec_1_1_fixture_keeps_its_lse_and_its_exact_stages():
    """blocks.block_case slices the lse computed at load and its bound by query row; the stages the
    fixture stores stay exact (reference_error names only lse: every other stage reads 0.0)."""
    from mhaspec.conformance.blocks import block_case

    golden = GoldenSet().load("long_sequence")  # B = 1, H = 2, T = S = 128
    block = block_case(golden, 0, 32, 64)
    assert block.stages["lse"].shape == (1, 2, 32) and block.reference_error["lse"].shape == (1, 2, 32)
    assert np.array_equal(block.stages["lse"], golden.stages["lse"][:, :, 32:64])
    assert np.array_equal(block.reference_error["lse"], golden.reference_error["lse"][:, :, 32:64])
    assert block.reference_error["scores"] == 0.0 and block.reference_error["output"] == 0.0


def test_a_variant_case_made_one_block_at_a_time_has_the_whole_case_s_numbers(monkeypatch):
    """onthefly.row_blocks of a case with every variant: each block (its bias rows, its q_rot rows, its
    lse, …) is those rows of the case computed whole (golden_case), and it knows its place in the case."""
    from mhaspec.conformance.blocks import block_case
    from mhaspec.reference import fast as fast_module
    from mhaspec.reference import onthefly
    from mhaspec.spec import CaseSpec

    monkeypatch.setattr(fast_module, "FAST_ROWS", 4)
    monkeypatch.setattr(onthefly, "FAST_ROWS", 4)
    monkeypatch.setattr(onthefly, "ROW_BLOCK_ELEMENTS", 2 * 8 * 11)  # blocks of 8 rows
    spec = CaseSpec(id="every", config=MHAConfig(**{"d_model": 12, "num_heads": 2, **VARIANT_CONFIGS[9]}),
                    batch=2, tgt_len=13, src_len=11, seed=9, bias={"per_head": True, "per_batch": True})
    lazy, whole = onthefly.row_blocks(spec), onthefly.golden_case(spec)
    assert lazy.block_rows == 8 and set(lazy.stages) == set(whole.stages) >= {"q_rot", "k_rot", "lse"}
    for b, t0, t1 in ((0, 0, 8), (1, 8, 13)):
        block, want = lazy.block(b, t0, t1), block_case(whole, b, t0, t1)
        assert (block.row_offset, block.whole_tgt_len) == (want.row_offset, want.whole_tgt_len) == (t0, 13)
        assert np.array_equal(block.inputs["bias"], want.inputs["bias"])
        for stage in whole.stages:
            assert np.array_equal(block.stages[stage], want.stages[stage]), stage
            assert np.array_equal(np.broadcast_to(block.reference_error[stage], want.stages[stage].shape),
                                  np.broadcast_to(want.reference_error[stage], want.stages[stage].shape)), stage
