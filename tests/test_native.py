"""The compiled loops' library (engine/native.py, csrc/): its loader, its argument checks, its attention
loop against numba's on the same inputs, and the switch that makes a missing build fail (tox, CI).

The library is optional (built where a C compiler is found at install time): where it is not built these
tests are skipped, unless ``MHASPEC_REQUIRE_NATIVE=1`` (set in tox's environments and CI, where gcc is
there), which makes :func:`test_the_library_is_built_where_it_is_required` fail instead, so that a broken
build never silently falls back to the numba or NumPy loops there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

#: 1 (tox, CI): the library must load here.
REQUIRE_ENV = "MHASPEC_REQUIRE_NATIVE"


def test_the_library_is_built_where_it_is_required():
    if os.environ.get(REQUIRE_ENV, "").strip() not in {"1", "yes", "true"}:
        pytest.skip(f"{REQUIRE_ENV} is not set: the library is optional here")
    from mhaspec.conformance.engine import native  # ImportError: not built (or stale): fails here

    assert native.attention_chunk is not None


@pytest.fixture(scope="module")
def native():
    """The library's loader (a fixture, not a module-level skip: that would skip the required-build check too)."""
    try:  # not importorskip: the loader raises ImportError (not built, stale), not ModuleNotFoundError
        from mhaspec.conformance.engine import native as loaded
    except ImportError as exc:
        pytest.skip(f"the compiled library is not built ({exc})")
    return loaded


def test_import_mhaspec_loads_neither_the_library_nor_numba():
    code = ("import sys, mhaspec, mhaspec.conformance, mhaspec.conformance.engine.compiled; "
            "print(sorted(m for m in sys.modules if m.endswith(('._loops', '.native')) or m == 'numba'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_library_built_with_other_constants_is_refused(monkeypatch, native):
    """A stale build (the model's constants changed since): ImportError, so the numba or NumPy loops judge."""
    native._load()  # this build: accepted
    monkeypatch.setattr(native, "EXP_PRODUCT", native.EXP_PRODUCT * 2)
    with pytest.raises(ImportError, match="stale build"):
        native._load()


def _chunk(rng: np.random.Generator, heads: int = 3, rows: int = 5, S: int = 37, masked: float = 0.3):
    """Inputs of an attention chunk (kernels.attention_chunk's, in its order but the outputs), of the
    sizes and magnitudes of a float32 case: scores, weights (the visible scores' softmax), the visibility
    (a fully masked row too), the float32 products, the constants."""
    s = rng.standard_normal((heads, rows, S)) * 3
    vis = rng.random((heads, rows, S)) >= masked
    vis[0, 1] = False
    e = np.where(vis, np.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    p = np.divide(e, e.sum(axis=-1, keepdims=True), out=np.zeros_like(e), where=e.sum(axis=-1, keepdims=True) > 0)
    m1 = (rng.random((heads, rows, S)) * 10).astype(np.float32)
    m2 = (rng.random((heads, rows, S)) * 3).astype(np.float32)
    u = 2.0**-24
    constants = dict(c1=1e-14, c2=0.125 * (1 + 1e-5), w_d=70 * u, s_d=8 * u, u2=u * u, ua=2 * u, w_s=40 * u,
                     s_s=6 * u, floor=1e-30, cap=1.0)
    return s, p, vis, m1, m2, constants


def _outputs(shape: tuple[int, int, int], seen: int):
    """The written arrays of a chunk, NaN-filled so that what a loop leaves unwritten shows."""
    heads, rows, S = shape
    full = lambda: np.full(shape, np.nan)  # noqa: E731
    narrow = lambda dtype=np.float64: np.full((heads, rows, seen), np.nan, dtype=dtype)  # noqa: E731
    return dict(bounds=[full() for _ in range(4)], tol=[full(), full()], lhs=narrow(), q=narrow(),
                pp32=narrow(np.float32), lhs32=narrow(np.float32), pk=np.full((heads, rows), np.nan),
                work=np.full((10, S), np.nan))


def _call(kernels, s, p, vis, m1, m2, c, out, *, ext=None, want_bounds=True, want_tol=True, seen=None):
    """kernels.call("attention_chunk", …) with the reference errors ``ext`` ((array, array) or (value, value))."""
    dummy = np.empty((1, 1, 1))
    arrays = ext is not None and not isinstance(ext[0], float)
    ext = ext or (0.0, 0.0)
    ext_args = ((ext[0], 0.0, ext[1], 0.0) if arrays else (dummy, ext[0], dummy, ext[1]))
    return kernels.call("attention_chunk", s, p, vis, m1, m2, c["c1"], c["c2"], c["w_d"], c["s_d"], c["u2"], c["ua"],
                        c["w_s"], c["s_s"], c["floor"], c["cap"], want_bounds, *out["bounds"], want_tol, arrays,
                        *ext_args, *out["tol"], out["lhs"], out["q"], out["pp32"], out["lhs32"], out["pk"],
                        out["work"], s.shape[-1] if seen is None else seen)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a == 0, b == 0)
    fin = np.isfinite(a) & (a != 0)
    assert np.array_equal(a[~fin & ~np.isnan(a)], b[~fin & ~np.isnan(b)])
    return float(np.max(np.abs(a[fin] - b[fin]) / np.abs(a[fin]), initial=0.0))


@pytest.mark.parametrize("seen", [37, 20])
@pytest.mark.parametrize("ext", ["values", "arrays"])
def test_the_attention_loop_is_numbas_on_the_same_inputs(seen, ext, native):
    """mh_attention_chunk against kernels.attention_chunk, every output, on inputs with masked keys, a
    fully masked row and keys past the last one seen: the tolerances of tests/test_kernels.py (relative
    1e-7 on the (heads, rows, S) bounds; the head outputs' operands too), the same finite flag."""
    kernels = pytest.importorskip("mhaspec.conformance.engine.kernels", reason="numba is not installed")
    rng = np.random.default_rng(5)
    s, p, vis, m1, m2, c = _chunk(rng)
    if seen < s.shape[-1]:  # keys no row sees: masked in every row, weights 0
        vis[..., seen:] = False
        p[..., seen:] = 0.0
    extra = ((0.0, 0.0) if ext == "values" else
             tuple(np.broadcast_to(rng.random((1, 1, s.shape[-1])) * 1e-9, s.shape) for _ in range(2)))
    got = []
    for impl in (kernels, native):
        out = _outputs(s.shape, seen)
        ok = _call(impl, s, p, vis, m1[..., :seen], m2[..., :seen], c, out, ext=extra, seen=seen)
        got.append((ok, out))
    (ok0, a), (ok1, b) = got
    assert ok0 is True and ok1 is True
    for x, y in zip(a["bounds"] + a["tol"], b["bounds"] + b["tol"]):
        assert not np.isnan(y).any()
        assert _rel(x, y) <= 1e-7
    for key in ("lhs", "q", "pp32", "lhs32", "pk"):
        assert _rel(a[key].astype(np.float64), b[key].astype(np.float64)) <= 1e-7, key
    # masked weights: no allowance at all
    assert not b["bounds"][2][~vis].any() and not b["bounds"][3][~vis].any()


def test_tolerances_alone_are_those_formed_with_the_bounds(native):
    rng = np.random.default_rng(6)
    s, p, vis, m1, m2, c = _chunk(rng)
    both, alone = _outputs(s.shape, s.shape[-1]), _outputs(s.shape, s.shape[-1])
    assert _call(native, s, p, vis, m1, m2, c, both, ext=(1e-12, 2e-12))
    assert _call(native, s, p, vis, m1, m2, c, alone, ext=(1e-12, 2e-12), want_bounds=False)
    assert all(np.array_equal(x, y) for x, y in zip(both["tol"], alone["tol"]))
    assert all(np.isnan(x).all() for x in alone["bounds"])  # not written


def test_a_value_that_is_not_finite_is_reported(native):
    rng = np.random.default_rng(7)
    s, p, vis, m1, m2, c = _chunk(rng)
    assert _call(native, s, p, vis, m1, m2, c, _outputs(s.shape, s.shape[-1]))
    for bad in (np.inf, np.nan):
        s2 = s.copy()
        s2[1, 2, 3] = bad
        assert not _call(native, s2, p, vis, m1, m2, c, _outputs(s.shape, s.shape[-1]))


def test_a_read_array_of_other_strides_is_copied_and_gives_the_same_numbers(native):
    """m1, m2 (read row by row) as views with a non-unit last stride, the visibility broadcast: copied or
    read with their strides, the same outputs bit for bit as from contiguous arrays."""
    rng = np.random.default_rng(8)
    s, p, vis, m1, m2, c = _chunk(rng, masked=0.0)
    wide = np.repeat(m1, 2, axis=-1)[..., ::2]
    assert wide.strides[-1] != wide.itemsize and np.array_equal(wide, m1)
    row_vis = np.broadcast_to(rng.random((1, 1, s.shape[-1])) >= 0.2, s.shape)
    expected, got = _outputs(s.shape, s.shape[-1]), _outputs(s.shape, s.shape[-1])
    assert _call(native, s, p, np.ascontiguousarray(row_vis), m1, m2, c, expected)
    assert _call(native, s, p, row_vis, wide, m2, c, got)
    for key in ("lhs", "q", "pp32", "lhs32", "pk"):
        assert np.array_equal(expected[key], got[key]), key
    assert all(np.array_equal(x, y) for x, y in zip(expected["bounds"] + expected["tol"], got["bounds"] + got["tol"]))


@pytest.mark.parametrize("spoil", ["dtype", "strides", "readonly", "ndim"])
def test_a_written_array_the_loop_cannot_write_is_refused(spoil, native):
    """A written array of another dtype, with a non-unit last stride, read-only, or of other axes:
    NativeError (compiled.call then warns and takes the NumPy loops), never a write elsewhere."""
    rng = np.random.default_rng(9)
    s, p, vis, m1, m2, c = _chunk(rng)
    out = _outputs(s.shape, s.shape[-1])
    q = out["q"]
    if spoil == "dtype":
        out["q"] = q.astype(np.float32)
    elif spoil == "strides":
        out["q"] = np.repeat(q, 2, axis=-1)[..., ::2]
    elif spoil == "readonly":
        q.flags.writeable = False
    else:
        out["q"] = q[0]
    with pytest.raises(native.NativeError, match="argument 29"):
        _call(native, s, p, vis, m1, m2, c, out)


def test_a_call_with_other_arguments_is_refused(native):
    with pytest.raises(native.NativeError, match="arguments"):
        native.call("attention_chunk", np.zeros((1, 1, 1)))


def test_a_library_without_every_loop_is_a_stale_build(native):
    """Loaded, the library has every loop of SIGNATURES at its level (else the import refuses it: numba or
    NumPy judge)."""
    assert native.lacking(native.SIGNATURES) == []
    assert native.lacking(["attention_chunk", "no_such_loop"]) == ["no_such_loop"]


# --- every loop at every level the processor runs (csrc/common.h, MH_LEVEL) ---------------------------

def _levels(native) -> tuple[str, ...]:
    levels = native.supported_levels()
    if len(levels) < 2:
        pytest.skip(f"this processor runs one build only ({levels})")
    return levels


def test_the_level_is_the_processors_unless_a_lower_one_is_named(native):
    levels = native.supported_levels()
    assert levels[0] == "base" and native.chosen_level({}) == levels[-1]
    assert native.LEVEL == native.chosen_level()  # bound once, as the environment names it (or not)
    for level in levels:
        assert native.chosen_level({"MHASPEC_LOOPS_LEVEL": level}) == level
    for wrong in ["avx2", *(level for level in native.LEVELS if level not in levels)]:
        with pytest.raises(ImportError, match="MHASPEC_LOOPS_LEVEL"):
            native.chosen_level({"MHASPEC_LOOPS_LEVEL": wrong})


def test_the_level_named_is_the_one_bound():
    code = "from mhaspec.conformance.engine import native; print(native.LEVEL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "MHASPEC_LOOPS_LEVEL": "base"})
    if "not built" in out.stderr:
        pytest.skip("the compiled library is not built")
    assert out.stdout.strip() == "base", out.stderr


def test_the_exponential_is_the_same_at_every_level(native):
    """mh_exp's edge cases at every level, and every level within one ulp of the baseline's (the AVX2 and AVX-512
    builds fuse the polynomial's multiply-adds, the baseline has no FMA), the AVX2 one bit for bit the AVX-512 one
    (the same contracted code: the 2^k scale without int64 conversions changes no bit)."""
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-800, 800, 200_000), rng.standard_normal(100_000) * 1e-3,
                        np.arange(-1076, 1025) * np.log(2), np.nextafter(np.arange(-1076, 1025) * np.log(2), 0)])
    base = native._exp_array(x, "base")
    for level in _levels(native):
        got = native._exp_array(x, level)
        assert np.array_equal(np.isfinite(got), np.isfinite(base))
        assert np.abs(got.view(np.int64) - base.view(np.int64)).max() <= 1
        edges = native._exp_array(np.array([np.nan, np.inf, -np.inf, 709.8, 710.0, -746.0, -800.0, 0.0, -0.0]), level)
        assert np.isnan(edges[0]) and list(edges[1:]) == [np.inf, 0.0, np.inf, np.inf, 0.0, 0.0, 1.0, 1.0]
        tiny = native._exp_array(np.array([-745.0, -740.0, -709.0]), level)  # subnormal results
        assert np.array_equal(tiny, np.exp(np.array([-745.0, -740.0, -709.0]))) or \
            np.abs(tiny.view(np.int64) - np.exp(np.array([-745.0, -740.0, -709.0])).view(np.int64)).max() <= 1
    if "v3" in native.supported_levels() and "v4" in native.supported_levels():
        assert np.array_equal(native._exp_array(x, "v3"), native._exp_array(x, "v4"))


def test_the_stage_loops_are_bit_for_bit_the_same_at_every_level(native):
    """stage.c's sums are in a fixed order with no fused multiply-add: the same figures at every level."""
    from . import test_native_stage as stage

    cases = [("ordinary", stage._stage())] + stage._views() + [(w, a) for w, a, _ in stage._ties()] + \
        [(w, a) for w, a, _ in stage._odd_stages()]
    levels = _levels(native)
    for what, a in cases:
        for flags in [(True, True, True), (False, True, True), (True, False, False)]:
            args = stage._args(a, *flags)
            got = [native._kernel("ordinary_stage", level)(*args) for level in levels]
            assert all(g == got[0] for g in got), what
    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 5, 1037))
    m = (rng.random(g.shape) < 0.5).astype(np.uint8)
    for name, v in [("sum_squares", g + rng.standard_normal(g.shape) * 1e-3),
                    ("sum_squares_f4", (g + 1e-3).astype(np.float32))]:
        got = [native._kernel(name, level)(v, g, m, True, True) for level in levels]
        assert all(x == got[0] for x in got) and np.isfinite(got[0][0])


def test_the_local_loops_agree_at_every_level(native):
    """local.c at every level against its baseline build: the closeness the C loops keep with numba's
    (tests/test_native_local.py: the softmax to 1e-14, the bounds to 1e-10, the scores' sigma 1e-15), the lse
    operands to 1e-10, what is formed without a multiply-add bit for bit."""
    from mhaspec.reference.onthefly import golden_case
    from mhaspec.spec.masks import seen_keys

    from . import test_native_local as local
    from .kernel_cases import CASES

    levels = _levels(native)
    for name in sorted(CASES):
        golden = golden_case(CASES[name])
        s, vis = local._chunk(golden, rows=slice(0, 130))
        runs = []
        for level in levels:
            a = local._weights_args(s, vis, seen_keys(vis))
            lse = np.zeros(s.shape[:2] + (7,))
            assert native._kernel("local_weights_lse_chunk", level)(*a, lse)
            b = local._weights_args(s, vis, seen_keys(vis))
            assert native._kernel("local_weights_chunk", level)(*b)
            assert all(np.array_equal(x, y) for x, y in zip(a[7:10], b[7:10]))
            runs.append((a, lse))
        for a, lse in runs[1:]:
            assert local._rel(runs[0][0][7], a[7]) <= 1e-14
            assert local._rel(runs[0][0][8], a[8]) <= 1e-10 and local._rel(runs[0][0][9], a[9]) <= 1e-10
            assert local._rel(runs[0][1], lse) <= 1e-10
        pc = golden.stages["attn_weights"][0]
        outs = []
        for level in levels:
            out = [np.empty(pc.shape, np.float32) for _ in range(2)]
            assert native._kernel("local_outputs_operands", level)(pc, *out)
            outs.append(out)
        assert all(np.array_equal(x, y) for out in outs[1:] for x, y in zip(outs[0], out))
    rng = np.random.default_rng(7)
    n, R, S, k = 3, 17, 90, 71
    ref = rng.standard_normal((n, R, S))
    m_sig, m_wor = (np.abs(rng.standard_normal((n, R, k))).astype(np.float32) for _ in range(2))
    runs = []
    for level in levels:
        args = [ref.copy(), m_sig, m_wor, 0.125, 3e-15, 2**-47, 2e-7, 1e-8, 1e-30, np.ones((n, R, S)),
                np.ones((n, R, S)), k]
        assert native._kernel("local_scores_chunk", level)(*args)
        runs.append(args)
    for args in runs[1:]:
        assert np.array_equal(args[0], runs[0][0]) and np.array_equal(args[10], runs[0][10])
        assert local._rel(runs[0][9], args[9]) <= 1e-15


def test_the_attention_loop_agrees_at_every_level(native):
    """attention.c at every level against its baseline build, every output: the closeness the C loop keeps
    with numba's (relative 1e-7, test_the_attention_loop_is_numbas_on_the_same_inputs), the same finite flag."""
    levels = _levels(native)
    rng = np.random.default_rng(7)
    s, p, vis, m1, m2, c = _chunk(rng)
    seen = 37
    vis[..., seen:] = False
    p[..., seen:] = 0.0
    runs = []
    for level in levels:
        out = _outputs(s.shape, seen)
        loop = SimpleNamespace(call=lambda name, *args, level=level: native._kernel(name, level)(*args))
        assert _call(loop, s, p, vis, m1[..., :seen], m2[..., :seen], c, out, seen=seen) is True
        runs.append(out)
    for out in runs[1:]:
        for x, y in zip(runs[0]["bounds"] + runs[0]["tol"], out["bounds"] + out["tol"]):
            assert _rel(x, y) <= 1e-7
        for key in ("lhs", "q", "pp32", "lhs32", "pk"):
            assert _rel(runs[0][key].astype(np.float64), out[key].astype(np.float64)) <= 1e-7, key
