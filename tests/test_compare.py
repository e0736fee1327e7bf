"""Meta tests of the comparison helpers: what they say when a stage is wrong."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mhaspec.conformance import compare
from mhaspec.conformance.compare import FAIL, PASS, compare_stage, representable, round_to_bfloat16


def test_exact_values_pass_with_zero_ratio():
    g = np.arange(6.0).reshape(2, 3)
    res = compare_stage("output", g.copy(), g, np.full(g.shape, 1e-3), "float64")
    assert (res.verdict, res.worst_ratio, res.max_abs_err, res.compared) == (PASS, 0.0, 0.0, 6)


def test_worst_element_is_reported_with_its_index_and_ratio():
    g = np.zeros((2, 3))
    got = g.copy()
    got[1, 2] = 0.5
    got[0, 1] = 0.2
    res = compare_stage("output", got, g, np.full(g.shape, 0.25), "float64")
    assert res.verdict == FAIL and res.worst_index == (1, 2) and res.worst_ratio == 2.0
    assert "1 of 6 elements exceed the tolerance; worst at (1, 2): got 0.5, expected 0" in res.message


def test_shape_and_dtype_problems_name_what_came():
    g = np.zeros((2, 3))
    assert compare_stage("concat", np.zeros((3, 2)), g, g + 1, "float64").message == "shape (3, 2), expected (2, 3)"
    assert "not a floating-point dtype" in compare_stage("concat", np.zeros((2, 3), int), g, g + 1, "float64").message


def test_nan_where_golden_is_finite_is_counted():
    g = np.ones((4,))
    got = np.array([1.0, np.nan, np.inf, 1.0])
    res = compare_stage("attn_weights", got, g, np.full(4, 1.0), "float64")
    assert res.verdict == FAIL and res.nonfinite == 2 and "2 NaN/inf value(s)" in res.message


def test_masked_scores_are_not_compared_but_masked_weights_must_be_zero():
    g = np.array([[0.5, 0.5, 0.0]])
    visible = np.array([[True, True, False]])
    scores = compare_stage("scores", np.array([[0.5, 0.5, -1e9]]), g, np.full(g.shape, 1e-6), "float64", visible)
    assert scores.verdict == PASS and scores.compared == 2
    tol = np.where(visible, 1e-6, 0.0)  # the model's tolerance on masked weights
    weights = compare_stage("attn_weights", np.array([[0.5, 0.5, 1e-30]]), g, tol, "float64")
    assert weights.verdict == FAIL and weights.worst_index == (0, 2)


def test_values_wider_than_the_dtype_are_rejected():
    g = np.array([1.0, 2.0])
    got = np.array([1.0 + 2**-20, 2.0])  # not a float16 number
    res = compare_stage("q_proj", got, g, np.full(2, 1.0), "float16")
    assert res.verdict == FAIL and "not representable in float16" in res.message


def test_bfloat16_rounding_matches_ml_dtypes():
    x = np.random.default_rng(0).standard_normal(10_000) * 10.0 ** np.random.default_rng(1).integers(-20, 20, 10_000)
    assert np.array_equal(round_to_bfloat16(x), x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
    assert representable(np.array([1.0, 1 + 2**-7, 1 + 2**-8]), "bfloat16").tolist() == [True, True, False]


def test_bfloat16_results_in_a_float16_run_are_recognised():
    golden = np.random.default_rng(2).standard_normal((4, 16)) * 3
    as_fp16 = golden.astype(np.float16).astype(np.float64)
    as_bf16 = round_to_bfloat16(golden)
    tol = np.full(golden.shape, 1.0)  # wide enough that only the precision check can fail
    assert compare_stage("q_proj", as_fp16, golden, tol, "float16").verdict == PASS
    res = compare_stage("q_proj", as_bf16, golden, tol, "float16")
    assert res.verdict == FAIL and "computed in bfloat16, not float16" in res.message
    # too few values to tell: no verdict from this check
    assert compare_stage("q_proj", as_bf16[:1, :8], golden[:1, :8], tol[:1, :8], "float16").verdict == PASS
    # data whose float16 values already fit 8 bits (here: small integers) is not informative
    ints = np.arange(64.0).reshape(4, 16)
    assert compare_stage("q_proj", ints, ints, tol, "float16").verdict == PASS


def _expected(got, g, tol, sigma, worst_part):
    """compare_stage's figures from their definitions (docs/spec.md §5), by plain numpy."""
    err = np.abs(got - g)
    ratio = np.where(tol > 0, err / np.where(tol > 0, tol, 1), np.where(err > 0, np.inf, 0.0))
    rel = np.where(g != 0, err / np.where(g != 0, np.abs(g), 1), np.where(err > 0, np.inf, 0.0))
    keep = sigma > 0
    z = np.maximum(err[keep] - worst_part[keep], 0.0) / sigma[keep]
    worst = np.unravel_index(int(np.argmax(ratio)), g.shape)
    return err.max(), rel.max(), ratio.max(), worst, float(np.sqrt(np.mean(z * z)))


def test_the_fast_and_the_general_forms_give_the_defined_figures_and_leave_the_arguments_alone():
    """Every value finite and every tolerance, golden value and sigma positive (the fast forms),
    then one zero of each (the general forms): the same figures as their definitions, and no
    argument written (float64 arrays are not copied on the way in)."""
    rng = np.random.default_rng(5)
    shape = (2, 3, 40, 50)
    g = rng.normal(size=shape)
    got = g + rng.normal(scale=1e-3, size=shape)
    sigma = rng.uniform(1e-4, 1e-3, size=shape)
    worst_part = rng.uniform(0, 1e-4, size=shape)
    tol = 8 * sigma + worst_part
    for zero in (False, True):
        if zero:
            g[0, 0, 0, 0] = got[0, 0, 0, 0] = 0.0
            sigma[1, 2, 3, 4] = 0.0
            tol[1, 1, 1, 1] = 0.0
            got[1, 1, 1, 1] = g[1, 1, 1, 1]
        args = [a.copy() for a in (got, g, tol, sigma, worst_part)]
        res = compare_stage("head_outputs", got, g, tol, "float64", noise=(sigma, worst_part), rms_limit=1.0,
                            rms_min_elements=16)
        for before, after in zip(args, (got, g, tol, sigma, worst_part)):
            np.testing.assert_array_equal(before, after)
        max_err, max_rel, max_ratio, worst, rms = _expected(got, g, tol, sigma, worst_part)
        assert res.max_abs_err == max_err and res.worst_index == worst
        np.testing.assert_allclose([res.max_rel_err, res.worst_ratio, res.rms_ratio], [max_rel, max_ratio, rms],
                                   rtol=1e-14)
        assert res.verdict == (FAIL if max_ratio > 1 or rms > 1 else PASS)


@pytest.mark.parametrize("chunk", [37, 50, 2000])
def test_a_large_stage_judged_in_chunks_gets_the_whole_stage_figures(monkeypatch, chunk):
    """Above COMPARE_CHUNK elements a passing stage is judged chunk by chunk (on strided views
    of a block too); the result is the one the whole-stage forms give, and anything out of the
    ordinary (an element over its tolerance, NaN, a zero tolerance, a value wider than the dtype)
    is judged whole, with the same messages."""
    rng = np.random.default_rng(11)
    shape = (2, 3, 40, 50)
    base = rng.normal(size=shape)
    g = base.astype(np.float32).astype(np.float64)  # representable in float32: the exact answer
    sigma = rng.uniform(1e-7, 1e-6, size=shape)
    worst_part = rng.uniform(0, 1e-7, size=shape)
    tol = 8 * sigma + worst_part
    got = (g + rng.normal(scale=1e-7, size=shape)).astype(np.float32).astype(np.float64)
    big = got.copy()
    big[1, 2, 30, 7] += 1.0  # one element far over its tolerance
    nan = got.copy()
    nan[0, 1, 2, 3] = np.nan
    wide = got.copy()
    wide[1, 0, 5, 5] += 1e-12  # not representable in float32
    zero_tol = tol.copy()
    zero_tol[0, 2, 11, 13] = 0.0
    rows = (slice(None), slice(None), slice(7, 33))  # a block of query rows: strided views
    cases = [(got, tol), (big, tol), (nan, tol), (wide, tol), (got, zero_tol),
             (got[rows], tol[rows]), (big[rows], tol[rows])]

    def judged(value, tolerance, **kw):
        index = rows if value.shape != shape else ()
        g_, s_, w_ = (a[index] for a in (g, sigma, worst_part))
        return compare_stage("attn_weights", value, g_, tolerance, "float32", noise=(s_, w_), rms_limit=1.0,
                             rms_min_elements=16, **kw).to_json()

    from mhaspec.conformance.engine import compiled

    monkeypatch.setattr(compiled, "loaded_kernels", lambda: None)  # the NumPy chunks (the compiled sweep:
    # tests/test_kernels.py), even where an earlier test of this process loaded the compiled loops
    taken = []
    chunks = compare._passing_in_chunks
    monkeypatch.setattr(compare, "_passing_in_chunks", lambda *a: taken.append(chunks(*a)) or taken[-1])
    for value, tolerance in cases:
        for kw in ({}, {"value_checks": False}):
            whole = judged(value, tolerance, **kw)
            monkeypatch.setattr(compare, "COMPARE_CHUNK", chunk)
            chunked = judged(value, tolerance, **kw)
            monkeypatch.setattr(compare, "COMPARE_CHUNK", 1 << 40)
            rms_whole, rms_chunked = whole.pop("rms_ratio"), chunked.pop("rms_ratio")
            assert chunked == whole
            if isinstance(rms_whole, float):
                assert rms_chunked == pytest.approx(rms_whole, rel=1e-13)
            else:
                assert rms_chunked == rms_whole
    assert judged(got, tol)["verdict"] == PASS and judged(big, tol)["verdict"] == FAIL
    # the chunks judged the passing stages (the whole one, the block, `wide` without value checks)
    # and left the others to the whole-stage forms
    assert sum(t is not None for t in taken) == 5 and sum(t is None for t in taken) == 9


def test_masked_attention_weights_are_judged_in_chunks_with_the_whole_stage_figures(monkeypatch):
    """A stage with exact zeros where its tolerance and sigma are 0 (masked attention weights) and
    zero golden values takes the chunks too, with the figures of the whole-stage forms: its ratio
    there is 0, the root mean square leaves those elements out; one inexact masked element is judged
    whole (a failure)."""
    from mhaspec.conformance.engine import compiled

    monkeypatch.setattr(compiled, "loaded_kernels", lambda: None)
    rng = np.random.default_rng(5)
    shape = (1, 4, 40, 60)
    visible = np.broadcast_to(np.tril(np.ones(shape[-2:], bool), 20), shape)
    g = np.where(visible, rng.uniform(1e-3, 1e-1, size=shape).astype(np.float32), 0.0)
    sigma = np.where(visible, rng.uniform(1e-7, 1e-6, size=shape), 0.0)
    worst_part = np.where(visible, rng.uniform(0, 1e-7, size=shape), 0.0)
    tol = 8 * sigma + worst_part
    got = np.where(visible, (g + rng.normal(scale=1e-7, size=shape)).astype(np.float32), 0.0)
    leak = got.copy()
    leak[0, 1, 2, 50] = 2.0**-20  # a masked weight that is not 0
    taken = []
    chunks = compare._passing_in_chunks
    monkeypatch.setattr(compare, "_passing_in_chunks", lambda *a: taken.append(chunks(*a)) or taken[-1])
    for value in (got, leak):
        results = []
        for chunk in (1 << 40, 50):
            monkeypatch.setattr(compare, "COMPARE_CHUNK", chunk)
            results.append(compare_stage("attn_weights", value, g, tol, "float32", noise=(sigma, worst_part),
                                         rms_limit=1.0, rms_min_elements=16).to_json())
        whole, chunked = results
        assert whole.pop("rms_ratio") == pytest.approx(chunked.pop("rms_ratio"), rel=1e-12)
        assert whole == chunked
    assert [t is not None for t in taken] == [True, False]
    assert results[0]["verdict"] == FAIL


@pytest.mark.parametrize("chunk", [1 << 40, 50])
def test_a_block_judged_up_to_the_keys_its_rows_see_gets_the_whole_stage_result(monkeypatch, chunk):
    """``keys`` (a causal block's rows see no key from there on): scores and attention weights are
    judged on their first ``keys`` keys, with the result of the whole stage (the same elements
    compared, the same worst index, the count of every compared element); where an entry beyond is
    not what the hint promises (a visible score, a nonzero weight), the stage is judged whole, with
    the whole stage's message."""
    from mhaspec.conformance.engine import compiled

    monkeypatch.setattr(compiled, "loaded_kernels", lambda: None)
    monkeypatch.setattr(compare, "COMPARE_CHUNK", chunk)
    rng = np.random.default_rng(17)
    B, H, T, S = 1, 3, 11, 29
    keys = 19  # rows 8..18 of a causal case: the last row sees key 18
    visible = (np.arange(S)[None, :] <= np.arange(8, 8 + T)[:, None])[None, None]  # (1, 1, T, S)
    shape = (B, H, T, S)
    full = np.broadcast_to(visible, shape)
    scores_g = rng.normal(size=shape).astype(np.float32).astype(np.float64)
    weights_g = np.where(full, rng.uniform(1e-3, 1e-1, size=shape).astype(np.float32), 0.0)
    sigma = np.where(full, rng.uniform(1e-7, 1e-6, size=shape), 0.0)
    worst_part = np.where(full, rng.uniform(0, 1e-7, size=shape), 0.0)
    tol = 8 * sigma + worst_part
    noise = rng.normal(scale=1e-7, size=shape)
    scores_got = np.where(full, (scores_g + noise).astype(np.float32), -np.inf)  # masked: anything
    weights_got = np.where(full, (weights_g + noise).astype(np.float32), 0.0)
    far = weights_got.copy()
    far[0, 2, 9, 3] += 0.5  # over its tolerance, within the keys
    leak = weights_got.copy()
    leak[0, 1, 2, 25] = 2.0**-20  # a masked weight beyond the keys that is not 0
    seen_score = full.copy()
    seen_score[0, 0, 0, 20] = True  # a selection that compares a score beyond the keys

    def judged(stage, got, golden, selected, hint):
        return compare_stage(stage, got, golden, tol, "float32", selected, noise=(sigma, worst_part),
                             rms_limit=1.0, rms_min_elements=16, keys=hint).to_json()

    cases = [("scores", scores_got, scores_g, visible), ("scores", scores_got, scores_g, seen_score),
             ("attn_weights", weights_got, weights_g, None), ("attn_weights", far, weights_g, None),
             ("attn_weights", leak, weights_g, None)]
    for stage, got, golden, selected in cases:
        whole, seen = judged(stage, got, golden, selected, None), judged(stage, got, golden, selected, keys)
        assert whole.pop("rms_ratio") == pytest.approx(seen.pop("rms_ratio"), rel=1e-12)
        assert seen == whole
    assert judged("scores", scores_got, scores_g, visible, keys)["compared"] == int(np.count_nonzero(full))
    assert judged("attn_weights", weights_got, weights_g, None, keys)["compared"] == weights_g.size
    assert [judged("attn_weights", got, weights_g, None, keys)["verdict"] for got in (weights_got, far, leak)] \
        == [PASS, FAIL, FAIL]
    assert f"of {weights_g.size} elements exceed the tolerance" in judged("attn_weights", far, weights_g, None,
                                                                          keys)["message"]


def test_an_array_of_the_dtype_itself_is_not_checked_for_representability_again():
    """``returned_dtype`` = ``dtype``: the adapter returned an array of the dtype itself, whose float64
    conversion holds only values of that dtype — the figures are those of the checked run; any other
    returned dtype (a float64 array in a float16 run) is still checked."""
    rng = np.random.default_rng(11)
    g = rng.normal(size=(3, 200))
    tol = np.full(g.shape, 1e-2)
    for dtype, kind in (("float16", np.float16), ("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        stored = (g + rng.normal(scale=1e-4, size=g.shape)).astype(kind)
        got = stored.astype(np.float64)
        assert compare.dtype_name(stored) == dtype
        checked = compare_stage("q_proj", got, g, tol, dtype).to_json()
        assert compare_stage("q_proj", got, g, tol, dtype, returned_dtype=dtype).to_json() == checked
        assert checked["verdict"] == PASS
    wide = g + 2**-20
    res = compare_stage("q_proj", wide, g, tol, "float16", returned_dtype=compare.dtype_name(wide))
    assert res.verdict == FAIL and "not representable in float16" in res.message
    assert compare.dtype_name([1.0]) is None  # no NumPy dtype: checked


def test_the_nth_compared_element_is_found_as_flatnonzero_finds_it():
    rng = np.random.default_rng(12)
    for shape in ((7,), (3, 5), (1, 4, 6, 9), (2, 1, 3, 1)):
        for density in (0.05, 0.5, 1.0):
            mask = rng.random(shape) < density
            where = np.flatnonzero(mask)
            assert [compare._nth_selected(mask, n) for n in range(where.size)] == where.tolist()


def test_the_relative_error_with_zero_golden_values_is_the_where_form():
    """:func:`compare._relative_max_with_zeros` against the whole-stage form it replaces in the chunks: 0
    where the golden is 0 and the element exact, inf where it is not, err/|golden| elsewhere."""
    rng = np.random.default_rng(13)
    for leak in (False, True):
        absolute = np.where(rng.random((4, 50)) < 0.3, 0.0, rng.uniform(1e-3, 1.0, size=(4, 50)))
        err = np.where(absolute > 0, rng.uniform(0, 1e-6, size=absolute.shape), 0.0)
        if leak:
            err.flat[np.argmin(absolute)] = 1e-9
        with np.errstate(divide="ignore", invalid="ignore"):
            expected = np.where(absolute > 0, err / absolute, np.where(err > 0, np.inf, 0.0)).max()
        assert compare._relative_max_with_zeros(err, absolute.copy()) == expected
        assert (expected == np.inf) == leak
