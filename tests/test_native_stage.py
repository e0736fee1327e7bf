"""The compiled library's stage sweep and sums of squares (csrc/stage.c) against numba's loop and NumPy's.

``mh_ordinary_stage`` is :func:`mhaspec.conformance.engine.kernels.ordinary_stage` term by term: the same
exits (every element out of the ordinary makes it give up, so that compare_stage judges the stage by
NumPy with every message), the same maxima and the same first index of the largest ratio; only Σ z² is
summed in another (fixed) order.  ``mh_sum_squares`` is the second opinion's Σ (v − g)² over a selection,
read in place: the NumPy sum's terms in another order (relative 1e-13 here), NaN and inf propagated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mhaspec.conformance import compare, second_opinion
from mhaspec.conformance.engine import compiled

native = pytest.importorskip("mhaspec.conformance.engine.native",
                             reason="the compiled loops' library is not built (no C compiler at install time)")
if native.ordinary_stage is None or native.sum_squares is None:
    pytest.skip("the library has no stage loops (a stale build)", allow_module_level=True)

# (N, R, C): rows of two whole segments of 512 and a tail of 76 elements (not a multiple of the sums' 8 lanes)
SHAPE = (3, 7, 1100)
NO_VIS = np.zeros((1, 1, 1), dtype=np.uint8)


def _stage(seed: int = 0, shape: tuple[int, ...] = SHAPE) -> dict[str, np.ndarray]:
    """A passing stage: float32 values within their tolerance of the golden, sigma and worst parts, a causal-like
    visibility (uint8, broadcast over the leading axis)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape)
    tol = np.abs(rng.standard_normal(shape)) * 1e-3 + 1e-3
    v = (g + rng.uniform(-0.9, 0.9, shape) * tol).astype(np.float32).astype(np.float64)
    vis = np.broadcast_to(np.tril(np.ones(shape[-2:], np.uint8), shape[-1] // 2), shape)
    return {"v": v, "g": g, "tol": tol, "sig": tol / 3, "wor": tol / 30, "vis": vis}


def _args(a: dict[str, np.ndarray], use_vis: bool = True, want_z: bool = True, check_float32: bool = True) -> tuple:
    return (a["v"], a["g"], a["tol"], a["sig"] if want_z else a["tol"], a["wor"] if want_z else a["tol"],
            a["vis"] if use_vis else NO_VIS, use_vis, want_z, check_float32)


def _same(got: tuple, expected: tuple) -> None:
    """The sweep's nine figures: all exact but Σ z² (index 6), summed in another order."""
    assert got[:6] + got[7:] == expected[:6] + expected[7:]
    assert got[6] == pytest.approx(expected[6], rel=1e-13, abs=0.0)


def _odd_stages() -> list[tuple[str, dict[str, np.ndarray], tuple[int, ...]]]:
    """(what, arrays, where): stages with one element out of the ordinary at ``where`` (a visible element)."""
    where = (1, 5, 300)  # visible: row 5 sees keys up to 555
    out = []
    for what, name, value in [("NaN value", "v", np.nan), ("inf value", "v", np.inf), ("-inf value", "v", -np.inf),
                              ("NaN golden", "g", np.nan), ("inf golden", "g", np.inf),
                              ("negative tolerance", "tol", -1e-3), ("NaN tolerance", "tol", np.nan),
                              ("negative sigma", "sig", -1e-9), ("NaN sigma", "sig", np.nan),
                              ("above the tolerance", "v", None), ("inexact at tolerance 0", "tol", 0.0),
                              ("not a float32", "v", "wide")]:
        a = {k: np.array(x) for k, x in _stage(1).items()}
        if value is None:  # an error 1.5 times the tolerance
            a["v"][where] = a["g"][where] + 1.5 * a["tol"][where]
        elif value == "wide":
            a["v"][where] += 1e-12
        else:
            a[name][where] = value
        out.append((what, a, where))
    return out


def test_an_ordinary_stage_gives_the_figures_and_every_odd_element_gives_up():
    """The figures of a passing stage (compared counts the visible elements; the worst ratio below 1), and
    ok = 0 (every figure 0) for each element out of the ordinary where it is compared — not where it is
    masked, not a float32 check where none is asked, not a sigma where no z is wanted."""
    a = _stage()
    found = native.call("ordinary_stage", *_args(a))
    assert found[0] is True and found[1] == int(np.count_nonzero(a["vis"])) and 0 < found[4] <= 1
    assert found[7] == found[1] and found[6] > 0 and found[8] is True
    for what, odd, where in _odd_stages():
        assert native.call("ordinary_stage", *_args(odd)) == (False, 0, 0.0, 0.0, 0.0, 0, 0.0, 0, False), what
        hidden = dict(odd, vis=np.array(odd["vis"]))
        hidden["vis"][where] = 0
        assert native.call("ordinary_stage", *_args(hidden))[0] is True, what
        if what == "not a float32":
            assert native.call("ordinary_stage", *_args(odd, check_float32=False))[0] is True
        if "sigma" in what:
            assert native.call("ordinary_stage", *_args(odd, want_z=False))[0] is True


def _views() -> list[tuple[str, dict[str, np.ndarray]]]:
    """The passing stage as views a judge passes: a strided block of rows, a tolerance broadcast over the
    leading axis, a last axis of stride 2 and of stride 0, a visibility broadcast over rows too."""
    a = _stage(2, (3, 14, 1100))
    rows = {k: x[:, ::2] for k, x in a.items()}  # every other row: a strided view
    tol0 = a["tol"][:1, ::2]
    shared = dict(rows, tol=np.broadcast_to(tol0, rows["v"].shape), sig=np.broadcast_to(tol0 / 3, rows["v"].shape),
                  wor=np.broadcast_to(tol0 / 30, rows["v"].shape))
    shared["v"] = (shared["g"] + 0.5 * shared["tol"]).astype(np.float32).astype(np.float64)
    wide = _stage(3, (3, 7, 2200))
    stepped = {k: x[..., ::2] for k, x in wide.items()}
    column = dict(_stage(4), tol=np.broadcast_to(np.full((3, 7, 1), 1e-2), SHAPE))
    column["v"] = (column["g"] + 1e-3).astype(np.float32).astype(np.float64)
    keys = dict(_stage(5), vis=np.broadcast_to((np.arange(1100) < 600).astype(np.uint8), SHAPE))
    return [("strided rows", rows), ("broadcast tolerance", shared), ("last stride 2", stepped),
            ("last stride 0", column), ("visibility broadcast over rows", keys)]


def _ties() -> list[tuple[str, dict[str, np.ndarray], int]]:
    """Stages whose largest ratio (0.5 exactly: |v − 0| / 1) is held by several elements: (what, arrays, the
    flat index of the first visible one)."""
    out = []
    N, R, C = SHAPE
    places = [(2, 4, 1030), (0, 3, 900), (0, 3, 1000), (0, 3, 40), (1, 0, 3)]
    for what, holders, hidden in [("across rows and segments", places, []),
                                  ("the first masked", places, [(0, 3, 40)]),
                                  ("in one segment", [(0, 6, 10), (0, 6, 11), (0, 6, 511)], []),
                                  ("only later rows", [(2, 6, 1099), (2, 5, 1099)], [])]:
        v = np.full(SHAPE, 0.25)
        v[0, 0, 0] = 0.4375  # a smaller earlier record
        for p in holders:
            v[p] = 0.5
        vis = np.ones(SHAPE, np.uint8)
        for p in hidden:
            vis[p] = 0
        a = {"v": v, "g": np.zeros(SHAPE), "tol": np.ones(SHAPE), "sig": np.full(SHAPE, 0.25),
             "wor": np.zeros(SHAPE), "vis": vis}
        first = min(np.ravel_multi_index(p, SHAPE) for p in holders if p not in hidden)
        out.append((what, a, int(first)))
    return out


def test_the_largest_ratio_held_by_several_elements_is_at_the_first_visible_one():
    for what, a, first in _ties():
        found = native.call("ordinary_stage", *_args(a))
        assert found[0] is True and found[4] == 0.5 and found[5] == first, what


def test_the_native_sweep_is_numbas_loop():
    """The same nine figures as numba's kernels.ordinary_stage (Σ z² to rounding) on passing stages, their
    views, ties and every exit; without numba, skipped."""
    kernels = pytest.importorskip("mhaspec.conformance.engine.kernels", reason="numba (the fast extra) is not installed")
    stages = [("ordinary", _stage())] + _views() + [(w, a) for w, a, _ in _ties()] + [(w, a) for w, a, _ in _odd_stages()]
    for what, a in stages:
        for flags in [(True, True, True), (False, True, True), (True, False, False), (False, False, True)]:
            args = _args(a, *flags)
            # numba's loop with its declared signature's types (contiguous float64s), so that this test
            # compiles no other signature in the process (tests/test_kernels.py counts them)
            declared = tuple(np.ascontiguousarray(x) if isinstance(x, np.ndarray) and x.dtype == np.float64 else x
                             for x in args)
            _same(native.call("ordinary_stage", *args), kernels.call("ordinary_stage", *declared))


def _judged(monkeypatch, loops, *args, **kwargs) -> dict:
    """compare_stage's result with ``loops`` as the loaded compiled loops (None: NumPy), as a dict."""
    monkeypatch.setattr(compiled, "loaded_kernels", lambda: loops)
    return dataclasses.asdict(compare.compare_stage(*args, **kwargs))


def _but_rounding(result: dict) -> dict:
    """A result without its root mean square (summed in another order) and, where that failed it, the
    message that names it."""
    out = {k: x for k, x in result.items() if k != "rms_ratio"}
    if "systematic" in out["message"]:
        del out["message"]
    return out


@pytest.mark.parametrize("shape", [(1, 8, 64, 1024), (1, 300, 512), (2, 4, 33, 257)])
def test_compare_stage_by_the_native_sweep_gives_the_numpy_result(shape, monkeypatch):
    """compare_stage on a large float32/float64 stage with the library as the loaded loops and by NumPy: the
    same result field for field (the root mean square to rounding), on a strided block, masked like scores
    and like attention weights, where a stage fails (each element out of the ordinary, systematic), and
    where the largest ratio is tied; the native sweep judged it (or gave up, for NumPy to judge)."""
    monkeypatch.setattr(compare, "COMPARE_CHUNK", 1 << 12)
    rows = (slice(None),) * (len(shape) - 2) + (slice(None, None, 2),)
    a = {k: x[rows] for k, x in _stage(8, shape[:-2] + (2 * shape[-2], shape[-1])).items()}  # strided views
    v, g, tol, noise, vis = a["v"], a["g"], a["tol"], (a["sig"], a["wor"]), a["vis"].astype(bool)
    on = lambda x: np.where(vis, x, 0.0)  # noqa: E731  (masked like attention weights: exactly 0, tolerance 0)
    cases = [(v, g, tol, dtype, visible, n, None if n is None else 0.6)
             for dtype in ("float32", "float64") for visible in (None, vis) for n in (None, noise)]
    cases += [(on(v), on(g), on(tol), "float32", None, n, 0.6) for n in (None, tuple(map(on, noise)))]
    for k, bad in enumerate([np.nan, np.inf, 1.0, 1e-12]):  # NaN, inf, above its tolerance, not a float32
        b = v.copy()
        b.flat[5 + 1000 * k] += bad
        cases.append((b, g, tol, "float32", None, None, None))
    inexact = on(v)
    inexact[(0,) * (len(shape) - 2) + (0, shape[-1] - 1)] = 2.0**-30  # masked, tolerance 0, not exact
    cases.append((inexact, on(g), on(tol), "float32", None, None, None))
    for name, value in [("tol", -1.0), ("tol", np.nan), ("sig", -1.0), ("sig", np.nan)]:
        t, s = tol.copy(), noise[0].copy()
        (t if name == "tol" else s).flat[77] = value
        cases.append((v, g, t, "float32", None, (s, noise[1]), 0.6))
    cases.append((v, g, tol, "float32", None, (tol / 1e6, tol * 0), 0.6))  # systematic
    tied_g, tied_t = g.copy(), tol.copy()  # the largest ratio, 0.5 exactly, three times
    tied_v = tied_g + np.clip(v - g, -0.25 * tol, 0.25 * tol)
    for at in (40, 3000, 9000):
        tied_g.flat[at], tied_t.flat[at], tied_v.flat[at] = 1.0, 2.0**-10, 1.0 + 2.0**-11
    cases.append((tied_v, tied_g, tied_t, "float64", None, None, None))
    calls = []
    real = native.ordinary_stage
    monkeypatch.setattr(native, "ordinary_stage", lambda *args: calls.append(1) or real(*args))
    verdicts = set()
    for got, gold, t, dtype, visible, n, rms in cases:
        taken = len(calls)
        swept, by_numpy = (_judged(monkeypatch, loops, "scores", got, gold, t, dtype, visible, noise=n, rms_limit=rms)
                           for loops in (native, None))
        assert len(calls) == taken + 1
        assert _but_rounding(swept) == _but_rounding(by_numpy)
        assert (swept["rms_ratio"] is None) == (by_numpy["rms_ratio"] is None)
        assert by_numpy["rms_ratio"] is None or swept["rms_ratio"] == pytest.approx(by_numpy["rms_ratio"], rel=1e-12)
        verdicts.add(swept["verdict"])
    assert verdicts == {"pass", "fail"}
    assert swept["worst_ratio"] == 0.5 and np.ravel_multi_index(swept["worst_index"], g.shape) == 40  # the tied case


def test_compare_stage_by_the_native_sweep_on_views_and_ties_gives_the_numpy_result(monkeypatch):
    """The same on the views of :func:`_views` (strided rows, a broadcast tolerance, last strides 2 and 0, a
    visibility broadcast over rows) and the ties of :func:`_ties` (the first visible holder reported)."""
    monkeypatch.setattr(compare, "COMPARE_CHUNK", 1 << 12)
    stages = [(what, a, None) for what, a in _views()] + _ties()
    for what, a, first in stages:
        visible = a["vis"].astype(bool)
        for dtype in ("float32", "float64"):
            swept, by_numpy = (_judged(monkeypatch, loops, "scores", a["v"], a["g"], a["tol"], dtype, visible,
                                       noise=(a["sig"], a["wor"]), rms_limit=4.0) for loops in (native, None))
            assert _but_rounding(swept) == _but_rounding(by_numpy), what
            assert swept["rms_ratio"] == pytest.approx(by_numpy["rms_ratio"], rel=1e-12), what
            assert swept["verdict"] == "pass", what
            if first is not None:
                assert np.ravel_multi_index(swept["worst_index"], SHAPE) == first, what


# ---- the sums of squares ------------------------------------------------------------------------------------

def _exact_sum(terms: np.ndarray) -> float:
    return math.fsum(np.asarray(terms, dtype=np.float64).ravel().tolist())


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_sum_of_squares_is_numpys_over_every_selection(dtype):
    """Σ (v − g)² and Σ v² over a random mask, a broadcast mask, none, on 4-D arrays, strided views and a
    broadcast golden: the exact sum of the same terms to a relative 1e-13; over an empty selection 0."""
    rng = np.random.default_rng(11)
    shape = (2, 3, 9, 1037)
    g = rng.standard_normal(shape)
    v = (g + rng.standard_normal(shape) * 1e-3).astype(dtype)
    masks = [None, rng.random(shape) < 0.4, np.broadcast_to(rng.random((1, 3, 1, 1037)) < 0.5, shape),
             np.zeros(shape, bool)]
    views = [(v, g), (v[:, :, ::2], g[:, :, ::2]), (v[..., ::3], g[..., ::3]),
             (v, np.broadcast_to(g[:1, :, :1], shape))]
    for vv, gg in views:
        B, H, T, S = vv.shape
        masks = [None, rng.random(vv.shape) < 0.4, np.broadcast_to(rng.random((1, H, 1, S)) < 0.5, vv.shape),
                 np.zeros(vv.shape, bool)]
        for mask in masks:
            sel = np.ones(vv.shape, bool) if mask is None else mask
            d = vv.astype(np.float64) - gg
            for golden, terms in [(gg, d * d), (None, vv.astype(np.float64) ** 2)]:
                total = compiled.sum_squares(native, vv, golden, mask)
                if not sel.any():
                    assert total == 0.0
                else:
                    assert total == pytest.approx(_exact_sum(terms[sel]), rel=1e-13, abs=0.0)


def test_a_nan_or_infinity_selected_propagates_and_one_left_out_does_not():
    """So that the second opinion's _finite_selection narrows its selection as with NumPy's sums."""
    rng = np.random.default_rng(12)
    shape = (2, 5, 700)
    g = rng.standard_normal(shape)
    mask = rng.random(shape) < 0.5
    inside, outside = np.argwhere(mask)[17], np.argwhere(~mask)[23]
    for bad, expect in [(np.nan, math.isnan), (np.inf, lambda x: x == math.inf), (-np.inf, lambda x: x == math.inf)]:
        v = g + 1e-3
        v[tuple(outside)] = bad
        left_out = compiled.sum_squares(native, v, g, mask)
        assert math.isfinite(left_out)
        assert left_out == pytest.approx(_exact_sum(((v - g) ** 2)[mask]), rel=1e-13)
        v[tuple(inside)] = bad
        assert expect(compiled.sum_squares(native, v, g, mask)), bad
        assert expect(compiled.sum_squares(native, v, None, mask)), bad


def test_the_numba_loops_and_other_dtypes_leave_the_sums_to_numpy():
    """compiled.sum_squares gives None (the caller's NumPy sum) where the loaded loops have no such sweep
    (numba's module, without one) or the values are neither float64 nor float32."""
    x = np.ones((4, 4, 4))

    class Numba:  # a module of loops without sum_squares
        pass

    assert compiled.sum_squares(Numba(), x, x, None) is None
    assert compiled.sum_squares(native, x.astype(np.float16), x, None) is None
    assert compiled.sum_squares(native, x, x, None) == 0.0


def _second_opinion_case():
    from mhaspec.reference.onthefly import golden_case
    from mhaspec.spec import CaseSpec, MHAConfig

    spec = CaseSpec(id="so_native", config=MHAConfig(d_model=32, num_heads=4, causal=True),
                    batch=1, tgt_len=256, src_len=256, inputs="self", seed=3)
    return golden_case(spec)


def test_the_second_opinion_by_the_native_sums_is_numpys(monkeypatch):
    """second_opinions with the library as the loaded loops (its sums over the selections in place) and by
    NumPy's sums (gathered): the same counts, the sums to a relative 1e-13 (the ratios then to ~1e-13),
    on the whole case and on a block of rows whose plain stages stop at the keys its rows see, with a NaN
    the selection leaves out."""
    from mhaspec.conformance.blocks import _slice_stage, block_case

    g = _second_opinion_case()
    own = {stage: values.astype(np.float64) for stage, values in
           next(iter(second_opinion.plain_forward(g, "float32", orders=("query-prescaled",))))[1].items()
           if stage in ("scores", "attn_weights", "head_outputs", "output")}
    own["attn_weights"] = own["attn_weights"].copy()
    own["attn_weights"][0, 1, 100, 3] = np.nan  # (row 100 sees key 3)
    block = block_case(g, 0, 64, 160)
    own_block = {stage: _slice_stage(stage, x, 0, 64, 160) for stage, x in own.items()}
    calls = []
    real = native.sum_squares
    for golden, stages in [(g, own), (block, own_block)]:
        monkeypatch.setattr(native, "sum_squares", lambda *a: calls.append(1) or real(*a))
        monkeypatch.setattr(compiled, "loaded_kernels", lambda: native)
        by_native = second_opinion.second_opinions(golden, "float32", stages)
        assert calls, "the native sums were not taken"
        calls.clear()
        monkeypatch.setattr(compiled, "loaded_kernels", lambda: None)
        by_numpy = second_opinion.second_opinions(golden, "float32", stages)
        assert calls == []
        assert by_native.keys() == by_numpy.keys()
        for stage, a in by_native.items():
            b = by_numpy[stage]
            assert a.compared == b.compared, stage
            assert a.adapter_ss == pytest.approx(b.adapter_ss, rel=1e-13, abs=0.0), stage
            assert a.floor_ss == pytest.approx(b.floor_ss, rel=1e-13, abs=0.0), stage
            assert a.plain_ss.keys() == b.plain_ss.keys()
            for order in a.plain_ss:
                assert a.plain_ss[order] == pytest.approx(b.plain_ss[order], rel=1e-13, abs=0.0), (stage, order)
    assert by_native["attn_weights"].compared < block.stages["attn_weights"].size  # the NaN left out
