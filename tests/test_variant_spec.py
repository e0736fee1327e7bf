"""The attention variants (docs/spec.md §2a): their config fields and validation, the window in the
one visibility rule, the exact reference against a plain numpy float64 implementation, the correct
rounding of its tanh / sin / cos / log-sum-exp, and a case that uses a variant accepted everywhere
(judged forward, in every dtype)."""

from __future__ import annotations

import json
import math
from decimal import Context, Decimal

import numpy as np
import pytest
from pydantic import ValidationError

from mhaspec.cli import main
from mhaspec.fixtures import DEFAULT_GOLDEN
from mhaspec.io.safetensors import PREFIX, header_length, parse_header
from mhaspec.reference import forward
from mhaspec.reference import rounding
from mhaspec.spec import CATALOG, STAGES, CaseSpec, Catalog, MHAConfig
from mhaspec.spec.masks import visibility
from mhaspec.spec.stages import VARIANT_STAGES, downstream, forward_stages, variant_stages
from mhaspec.spec.variants import NOT_JUDGED_YET, refusal, standard_alibi_slopes, variants_used

U = 2.0**-53


def safetensors_header(data: bytes) -> dict:
    """The JSON header of a safetensors file's bytes."""
    n = header_length(data[:PREFIX])
    return parse_header(data[PREFIX:PREFIX + n])


# -- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field", [
    ({"window_left": -1}, "window_left"),
    ({"window_right": -3}, "window_right"),
    ({"softcap": 0.0}, "softcap"),
    ({"softcap": -5.0}, "softcap"),
    ({"softcap": float("inf")}, "softcap"),
    ({"alibi_slopes": [0.5, 0.25]}, "alibi_slopes"),  # H = 3
    ({"alibi_slopes": "geometric"}, "alibi_slopes"),
    ({"alibi_slopes": [0.5, float("nan"), 0.1]}, "alibi_slopes[1]"),
    ({"rope": {"rotary_dim": 3}}, "rope.rotary_dim"),
    ({"rope": {"rotary_dim": 8}}, "rope.rotary_dim"),  # head_dim 6
    ({"rope": {"style": "neox"}}, "style"),
    ({"rope": {"theta": 0.0}}, "theta"),
    ({"rope": {"query_offset": -1}}, "query_offset"),
    ({"sinks": "yes"}, "sinks"),
])
def test_a_bad_variant_field_is_an_error_naming_it(fields, field):
    with pytest.raises(ValidationError) as err:
        MHAConfig(d_model=12, num_heads=3, head_dim=6, **fields)
    text = str(err.value)
    assert field in text, text


def test_an_odd_default_rotary_dim_says_it_is_the_head_dim():
    with pytest.raises(ValidationError, match=r"rope.rotary_dim: must be even and <= head_dim=5, got 5 \(the default"):
        MHAConfig(d_model=15, num_heads=3, rope={})


def test_a_variant_config_resolves_and_dumps_what_is_on():
    cfg = MHAConfig(d_model=12, num_heads=3, head_dim=6, rope={"theta": 500.0}, window_left=2, softcap=30.0)
    assert cfg.rope.rotary_dim == 6 and cfg.has_variants
    dumped = cfg.model_dump(mode="json")
    assert dumped["rope"]["rotary_dim"] == 6 and dumped["window_left"] == 2 and "window_right" not in dumped
    assert MHAConfig.model_validate(dumped) == cfg  # what is dumped reads back the same


# -- spec-1.1 cases unchanged -------------------------------------------------------------------------

def test_defaults_leave_every_committed_case_json_and_manifest_unchanged():
    manifest = json.loads((DEFAULT_GOLDEN / "manifest.json").read_text())
    by_id = {entry["spec"]["id"]: entry["spec"] for entry in manifest["cases"]}
    assert set(by_id) == set(CATALOG.ids())
    assert manifest["spec_version"] == "1.2"
    plain = [spec for spec in CATALOG if not spec.config.has_variants and spec.bias is None and spec.schedule is None
             and spec.seq_lens is None]
    assert len(plain) == 28  # the spec-1.1 catalog (schedules and packed cases came later: docs/serving.md)
    for spec in CATALOG:
        assert spec.model_dump(mode="json") == by_id[spec.id], spec.id
        assert CaseSpec.model_validate(by_id[spec.id]) == spec
    for spec in plain:  # a spec-1.1 case dumps no variant field, and its file still says spec 1.1
        assert not set(by_id[spec.id]) & {"bias"} and not set(by_id[spec.id]["config"]) & {
            "window_left", "window_right", "softcap", "alibi_slopes", "sinks", "rope"}, spec.id
        header = safetensors_header((DEFAULT_GOLDEN / f"{spec.id}.safetensors").read_bytes())
        assert header["__metadata__"]["spec_version"] == "1.1", spec.id
    from mhaspec.reference.generate import check

    assert check(DEFAULT_GOLDEN, CATALOG) == []  # every fixture's bytes and the manifest's (generate --check)


def test_the_spec_1_1_stages_are_unchanged_and_the_variant_stages_are_declared_beside_them():
    assert STAGES == ("q_proj", "k_proj", "v_proj", "scores", "attn_weights", "head_outputs", "concat", "output")
    assert VARIANT_STAGES == ("q_rot", "k_rot", "lse")
    plain = MHAConfig(d_model=12, num_heads=3)
    roped = MHAConfig(d_model=12, num_heads=3, rope={})
    assert variant_stages(plain) == ("lse",) and variant_stages(roped) == ("q_rot", "k_rot", "lse")
    assert forward_stages(roped)[:6] == ("q_proj", "k_proj", "v_proj", "q_rot", "k_rot", "scores")
    assert downstream("k_proj") == ("k_proj", "scores", "attn_weights", "head_outputs", "concat", "output")
    assert "k_rot" in downstream("k_proj", roped) and "lse" in downstream("scores", roped)
    assert roped.variant_stage_shapes(2, 5, 7) == {"q_rot": (2, 5, 12), "k_rot": (2, 7, 12), "lse": (2, 3, 5)}


# -- the window in the visibility rule -----------------------------------------------------------------

@pytest.mark.parametrize("T, S, align", [(5, 5, "top_left"), (4, 9, "bottom_right"), (7, 3, "bottom_right"),
                                          (6, 8, "top_left")])
@pytest.mark.parametrize("left, right", [(0, 0), (2, None), (None, 1), (1, 3), (20, 20)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_window_follows_flash_attention_s_rule_anded_with_causal(T, S, align, left, right, causal):
    cfg = MHAConfig(d_model=6, num_heads=2, causal=causal, causal_alignment=align, window_left=left,
                    window_right=right)
    got = visibility(cfg, None, 1, T, S)[0, 0]
    off = 0 if align == "top_left" else S - T
    for i in range(T):
        for j in range(S):
            want = ((left is None or j >= i + off - left) and (right is None or j <= i + off + right)
                    and (not causal or j <= i + off))
            assert got[i, j] == want, (i, j)


def test_window_edges():
    base = dict(d_model=6, num_heads=2)
    diag = visibility(MHAConfig(**base, window_left=0, window_right=0), None, 1, 5, 5)[0, 0]
    assert np.array_equal(diag, np.eye(5, dtype=bool))  # window 0: each row sees its own key only
    wide = visibility(MHAConfig(**base, causal=True, window_left=9, window_right=9), None, 1, 6, 9)[0, 0]
    assert np.array_equal(wide, visibility(MHAConfig(**base, causal=True), None, 1, 6, 9)[0, 0])  # >= S: no effect
    tall = visibility(MHAConfig(**base, causal=True, causal_alignment="bottom_right", window_left=1), None, 1, 7, 3)
    seen = tall[0, 0].sum(axis=-1)
    assert seen.tolist() == [0, 0, 0, 0, 1, 2, 2]  # T > S bottom-right: the first T - S rows see no key


# -- the exact reference against plain numpy ---------------------------------------------------------

def naive_forward(cfg: MHAConfig, inputs: dict, weights: dict, seq_lens=None) -> dict[str, np.ndarray]:
    """The variants written out directly in float64 numpy (np.tanh, np.cos, np.exp: not correctly rounded);
    ``seq_lens``: a packed case's lengths (keys j >= l_b invisible to entry b, docs/serving.md)."""
    x_q, x_k, x_v = inputs["query"], inputs["key"], inputs["value"]
    B, T, _ = x_q.shape
    S = x_k.shape[1]
    H, G, D = cfg.H, cfg.H_kv, cfg.D_k
    bias = lambda n: weights.get(n, 0.0)  # noqa: E731
    q, k, v = x_q @ weights["w_q"] + bias("b_q"), x_k @ weights["w_k"] + bias("b_k"), x_v @ weights["w_v"] + bias("b_v")
    out = {"q_proj": q, "k_proj": k, "v_proj": v}

    def turn(x, heads, pos):
        r = cfg.rope.rotary_dim
        x = x.reshape(B, -1, heads, D).copy()
        inv = cfg.rope.theta ** (-2.0 * np.arange(r // 2) / r)
        ang = pos[:, None] * inv[None, :]  # (L, r/2)
        c, s = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
        if cfg.rope.style == "half":
            a, b = x[..., : r // 2].copy(), x[..., r // 2: r].copy()
            x[..., : r // 2], x[..., r // 2: r] = a * c - b * s, b * c + a * s
        else:
            a, b = x[..., 0:r:2].copy(), x[..., 1:r:2].copy()
            x[..., 0:r:2], x[..., 1:r:2] = a * c - b * s, b * c + a * s
        return x.reshape(B, -1, heads * D)

    if cfg.rope is not None:
        q = out["q_rot"] = turn(q, H, cfg.rope.query_offset + np.arange(T, dtype=float))
        k = out["k_rot"] = turn(k, G, cfg.rope.key_offset + np.arange(S, dtype=float))
    Q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)
    K = np.repeat(k.reshape(B, S, G, D).transpose(0, 2, 1, 3), H // G, axis=1)
    V = np.repeat(v.reshape(B, S, G, -1).transpose(0, 2, 1, 3), H // G, axis=1)
    s = cfg.scale * np.einsum("bhtd,bhsd->bhts", Q, K)
    if cfg.softcap is not None:
        s = cfg.softcap * np.tanh(s / cfg.softcap)
    if inputs.get("bias") is not None:
        s = s + inputs["bias"]
    if cfg.alibi_slopes is not None:
        slopes = np.array(standard_alibi_slopes(H) if cfg.alibi_slopes == "standard" else cfg.alibi_slopes)
        off = 0 if cfg.causal_alignment == "top_left" else S - T
        dist = np.abs(np.arange(T)[:, None] + off - np.arange(S)[None, :])
        s = s - slopes[None, :, None, None] * dist
    vis = np.ones((T, S), bool)
    off = 0 if cfg.causal_alignment == "top_left" else S - T
    jj, ii = np.meshgrid(np.arange(S), np.arange(T))
    if cfg.causal:
        vis &= jj <= ii + off
    if cfg.window_left is not None:
        vis &= jj >= ii + off - cfg.window_left
    if cfg.window_right is not None:
        vis &= jj <= ii + off + cfg.window_right
    vis = np.broadcast_to(vis, s.shape)
    if inputs.get("mask") is not None:
        vis = vis & inputs["mask"]
    if seq_lens is not None:
        vis = vis & (np.arange(S)[None, None, None, :] < np.asarray(seq_lens)[:, None, None, None])
    logits = np.where(vis, s, -np.inf)
    if cfg.sinks:
        sink = np.broadcast_to(weights["sink_logits"][None, :, None, None], (B, H, T, 1))
        logits = np.concatenate([logits, np.where(vis.any(-1, keepdims=True), sink, -np.inf)], axis=-1)
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    tot = e.sum(-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0.0)[..., :S]
    lse = np.where(vis.any(-1), (m + np.log(np.where(tot > 0, tot, 1)))[..., 0], -np.inf)
    o = p @ V
    c = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
    out.update(scores=s, attn_weights=p, head_outputs=o, concat=c, output=c @ weights["w_o"] + bias("b_o"), lse=lse)
    return out


def _spec(case_id: str, seed: int = 31, T: int = 5, S: int = 7, **config) -> CaseSpec:
    fields = {k: config.pop(k) for k in ("bias", "mask") if k in config}
    return CaseSpec(id=case_id, config=MHAConfig(**{"d_model": 10, "num_heads": 3, "head_dim": 6, **config}),
                    batch=2, tgt_len=T, src_len=S, seed=seed, **fields)


VARIANTS = {
    "window": dict(window_left=2, window_right=1),
    "window_causal_br": dict(window_left=1, causal=True, causal_alignment="bottom_right"),
    "window_t_gt_s": dict(window_left=1, causal=True, causal_alignment="bottom_right", T=7, S=4),
    "softcap": dict(softcap=0.75),
    "alibi_standard": dict(alibi_slopes="standard", causal=True),
    "alibi_list_br": dict(alibi_slopes=(0.5, 0.125, 1.5), causal_alignment="bottom_right"),
    "bias": dict(bias={"per_head": True, "per_batch": True}),
    "bias_shared": dict(bias={"per_head": False}),
    "sinks": dict(sinks=True),
    "sinks_masked_rows": dict(sinks=True, mask={"kind": "random", "density": 0.6, "fully_masked": ((0, 1),)}),
    "rope_half": dict(rope={"theta": 100.0}),
    "rope_interleaved_partial": dict(rope={"style": "interleaved", "rotary_dim": 4, "theta": 50.0}),
    "rope_offsets_gqa": dict(rope={"query_offset": 3, "key_offset": 1, "theta": 1000.0}, num_heads=4, num_kv_heads=2,
                             d_model=12),
    "mistral": dict(window_left=3, causal=True, num_heads=4, num_kv_heads=2, d_model=12),
    "gemma2": dict(softcap=1.5, window_left=2, causal=True),
    "gpt_oss": dict(sinks=True, window_left=2, causal=True, rope={"theta": 150.0}),
    "everything": dict(rope={"style": "interleaved", "query_offset": 2}, softcap=2.0, alibi_slopes="standard",
                       bias={}, sinks=True, window_left=3, window_right=0, causal_alignment="bottom_right"),
}


def _scaled_close(name: str, got: np.ndarray, want: np.ndarray, ulps: float = 64) -> None:
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)) and np.array_equal(got[~finite], want[~finite]), name
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-300)
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    assert err <= ulps * U * scale, f"{name}: {err:.3g} > {ulps} ulps of {scale:.3g}"


@pytest.mark.parametrize("case_id", [spec.id for spec in CATALOG if variants_used(spec)])
def test_every_variant_fixture_agrees_with_plain_numpy(case_id):
    """The catalog's variant cases (their committed fixtures' forward stages) against the plain numpy
    implementation above, stage by stage (their backward: tests/test_variant_backward_reference.py)."""
    from mhaspec.fixtures import GoldenSet

    golden = GoldenSet().load(case_id)
    assert golden.reference_error is None  # every stage stored exactly, lse included
    naive = naive_forward(golden.spec.config, golden.inputs, golden.weights, golden.spec.seq_lens)
    assert set(naive) == set(forward_stages(golden.spec.config)) <= set(golden.stages)
    for stage in naive:
        _scaled_close(f"{case_id}: {stage}", golden.stages[stage], naive[stage])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_exact_reference_agrees_with_plain_numpy(variant):
    spec = _spec(variant, **dict(VARIANTS[variant]))
    inputs, weights = spec.make_inputs(), spec.make_weights()
    exact, naive = forward(spec.config, inputs, weights), naive_forward(spec.config, inputs, weights)
    assert set(naive) == set(exact) == set(forward_stages(spec.config))
    for stage in naive:
        _scaled_close(f"{variant}: {stage}", exact[stage], naive[stage])
    spec.case("float32")  # the adapter-facing case accepts the variant's inputs and weights


def test_rope_styles_rotary_dim_and_offsets():
    half = _spec("h", rope={"style": "half"})
    inter = _spec("i", rope={"style": "interleaved"})
    x, w = half.make_inputs(), half.make_weights()
    a, b = forward(half.config, x, w), forward(inter.config, x, w)
    assert not np.allclose(a["q_rot"], b["q_rot"]) and np.array_equal(a["q_proj"], b["q_proj"])
    # position 0 does not turn
    assert np.array_equal(a["q_rot"][:, 0], a["q_proj"][:, 0])
    partial = _spec("p", rope={"rotary_dim": 2})
    p = forward(partial.config, x, w)
    heads = lambda t: t.reshape(*t.shape[:2], 3, 6)  # noqa: E731
    assert np.array_equal(heads(p["q_rot"])[..., 2:], heads(p["q_proj"])[..., 2:])  # features past rotary_dim pass
    assert not np.array_equal(heads(p["q_rot"])[..., :2], heads(p["q_proj"])[..., :2])
    # RoPE is relative: the same offset on queries and keys leaves the scores (nearly) unchanged,
    # an offset on the queries alone does not
    same = _spec("o", rope={"query_offset": 11, "key_offset": 11})
    only_q = _spec("q", rope={"query_offset": 11})
    s0, s1, s2 = (forward(sp.config, x, w)["scores"] for sp in (half, same, only_q))
    _scaled_close("offsets", s1, s0, ulps=64)
    assert not np.allclose(s2, s0, atol=1e-3)


def test_sinks_take_a_share_of_each_row_and_enter_the_lse():
    spec = _spec("s", sinks=True, mask={"kind": "random", "density": 0.6, "fully_masked": ((1, 2),)})
    x, w = spec.make_inputs(), spec.make_weights()
    out = forward(spec.config, x, w)
    rows = out["attn_weights"].sum(axis=-1)  # (B, H, T)
    seen = visibility(spec.config, x["mask"], 2, 5, 7).any(axis=-1)
    assert np.all(rows[seen] < 1) and np.all(rows[seen] > 0) and np.all(rows[~seen] == 0)
    assert np.all(out["lse"][~seen] == -np.inf) and np.isfinite(out["lse"][seen]).all()
    plain = forward(spec.config.model_copy(update={"sinks": False}), x, {k: v for k, v in w.items() if k != "sink_logits"})
    assert np.all(out["lse"][seen] > plain["lse"][seen])  # the sink adds to every denominator
    sink = np.broadcast_to(w["sink_logits"][None, :, None], rows.shape)
    # 1 - Σp is the sink's share: e^sink / e^lse
    np.testing.assert_allclose((1 - rows)[seen], np.exp(sink - out["lse"])[seen], rtol=1e-12)
    # a dominating sink
    big = dict(w, sink_logits=np.full(3, 40.0))
    assert np.all(forward(spec.config, x, big)["attn_weights"].sum(-1) < 1e-12)


def test_softcap_is_monotone_and_bounded():
    from mhaspec.reference.variants import softcap

    s = np.array(sorted({0.0, -0.0, 1e-300, -1e-20, 0.3, 1.0, -7.5, 29.0, 30.0, 31.0, 300.0, -1e5, 1e300, 2.0**-1074}))
    c = softcap(s.reshape(1, 1, 1, -1), 30.0).ravel()
    assert np.all(np.diff(c) >= 0) and np.all(np.abs(c) <= 30.0) and np.all(np.sign(c) == np.sign(s))
    assert c[-1] == 30.0 and np.all(np.abs(c[np.abs(s) < 1e-10] - s[np.abs(s) < 1e-10]) == 0)  # tanh(x) ~ x


def test_empty_rows_and_t_greater_than_s():
    spec = _spec("t", T=7, S=4, window_left=0, causal=True, causal_alignment="bottom_right")
    out = forward(spec.config, spec.make_inputs(), spec.make_weights())
    assert np.all(out["attn_weights"][:, :, :3] == 0) and np.all(out["lse"][:, :, :3] == -np.inf)
    assert np.all(out["attn_weights"][:, :, 3:].sum(-1) == 1.0)  # window 0: one key each, weight exactly 1


# -- correct rounding --------------------------------------------------------------------------------

def _points(n: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 3, n)).tolist()


def test_softcap_and_lse_round_correctly_against_decimal_at_300_digits():
    """Independent formulas at 300 digits (tanh = (e^2x − 1)/(e^2x + 1); ln Σ e^v directly), rounded once."""
    ctx = Context(prec=300)
    for x in _points(300, 1):
        for cap in (1.0, 30.0, 0.375):
            e = ctx.exp(ctx.multiply(2, ctx.divide(Decimal(x), Decimal(cap))))
            want = float(ctx.multiply(Decimal(cap), ctx.divide(ctx.subtract(e, 1), ctx.add(e, 1))))
            assert rounding.softcap(x, cap) == want, (x, cap)
    rng = np.random.default_rng(2)
    for n in (1, 2, 5, 17):
        for _ in range(40):
            v = (rng.standard_normal(n) * 20).tolist()
            total = sum((ctx.exp(Decimal(a)) for a in v), Decimal(0))
            assert rounding.log_sum_exp(v) == float(ctx.ln(total)), v


def test_rope_cos_sin_round_correctly_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 400
    for position in (0, 1, 2, 7, 100, 4097, 123457):
        for pair, r, theta in ((0, 8, 10000.0), (1, 8, 10000.0), (3, 8, 10000.0), (5, 64, 500000.0), (2, 6, 1.5)):
            angle = position * mpmath.power(mpmath.mpf(theta), mpmath.mpf(-2 * pair) / r)
            cos, sin = rounding.rope_cos_sin(position, pair, r, theta)
            assert cos == float(mpmath.cos(angle)) and sin == float(mpmath.sin(angle)), (position, pair, r)


def test_softcap_rounds_correctly_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 400
    for x in _points(400, 3):
        assert rounding.softcap(x, 50.0) == float(50 * mpmath.tanh(mpmath.mpf(x) / 50)), x


def test_standard_alibi_slopes_are_press_et_al_s():
    def get_slopes(n):  # the ALiBi paper's code (ofirpress/attention_with_linear_biases)
        def power_of_2(n):
            start = 2 ** (-2 ** -(math.log2(n) - 3))
            return [start * start**i for i in range(n)]
        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + get_slopes(2 * closest)[0::2][: n - closest]

    ctx = Context(prec=100)
    for n in (1, 2, 3, 5, 8, 12, 16, 24, 40):
        ours = standard_alibi_slopes(n)
        # the paper's code multiplies rounded powers (an ulp or two off); ours are each correctly rounded
        np.testing.assert_allclose(ours, get_slopes(n), rtol=16 * U)
        m = 2 ** math.floor(math.log2(n))
        exponents = [Decimal(-8 * (h + 1)) / m for h in range(m)] + [Decimal(-4 * (2 * k + 1)) / m for k in range(n - m)]
        assert list(ours) == [float(ctx.power(Decimal(2), e)) for e in exponents], n
    assert standard_alibi_slopes(8) == tuple(2.0 ** -(h + 1) for h in range(8))  # exact powers of two


# -- judged: a case with a variant is accepted everywhere ----------------------------------------------

ACCEPTED = [("window_left", {"window_left": 2}), ("softcap", {"softcap": 20.0}), ("rope", {"rope": {}}),
            ("alibi_slopes", {"alibi_slopes": "standard"}), ("sinks", {"sinks": True})]


@pytest.mark.parametrize("field, config", ACCEPTED + [("bias", None)])
def test_a_case_with_a_variant_is_accepted_by_cases_generate_and_run(field, config, tmp_path, capsys):
    """Nothing is refused any more (NOT_JUDGED_YET is empty): cases --catalog lists the case, generate
    --catalog writes a fixture with lse (and q_rot, k_rot with rope), d_output and the backward (d_q_rot,
    d_k_rot with rope, d_sink_logits with sinks, d_bias with a bias input), and the runner takes it (an
    adapter that does not declare the variant: unsupported, never sent)."""
    from mhaspec.fixtures import GoldenSet

    assert NOT_JUDGED_YET == frozenset()
    case = {"id": "my_variant", "config": {"d_model": 8, "num_heads": 2, **(config or {})}, "batch": 1,
            "tgt_len": 3, "src_len": 4, "seed": 0}
    if config is None:
        case["bias"] = {"per_head": True}
    path = tmp_path / "variant.json"
    path.write_text(json.dumps([case]))
    assert main(["cases", "--catalog", str(path)]) == 0
    assert "my_variant" in capsys.readouterr().out
    assert main(["generate", "--catalog", str(path), "--out", str(tmp_path / "out")]) == 0
    golden = GoldenSet(tmp_path / "out").load("my_variant")
    assert "lse" in golden.stages and golden.d_output is not None and "d_query" in golden.stages
    assert ("q_rot" in golden.stages) == ("d_q_rot" in golden.stages) == (field == "rope")
    assert ("d_sink_logits" in golden.stages) == (field == "sinks")
    assert ("d_bias" in golden.stages) == (field == "bias")
    import mhaspec
    from mhaspec.adapters.numpy_mha import NumpyMHA
    from mhaspec.reference.onthefly import OnTheFlyGolden

    class Plain(NumpyMHA):  # declares no variant
        name = "plain"
        variants = frozenset()

    report = mhaspec.check(Plain(), dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None, isolate=False)
    assert [(r.case, r.verdict) for r in report.results] == [("my_variant", "unsupported")]
    assert "does not declare the variant" in report.results[0].message


def test_a_catalog_built_in_python_accepts_a_variant():
    spec = _spec("py_variant", softcap=3.0)
    assert refusal(spec) is None and refusal(_spec("plain")) is None
    assert Catalog([spec]).ids() == ["py_variant"]


def _drawn(n: int = 150) -> list[CaseSpec]:
    """``n`` cases the fuzzer draws (derandomized)."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings

    from mhaspec.fuzz import case_specs

    drawn: list[CaseSpec] = []

    @settings(max_examples=n, derandomize=True, suppress_health_check=list(HealthCheck), deadline=None, database=None)
    @given(case_specs(max_len=6, max_heads=4, max_head_dim=8, max_features=32))
    def draw(spec):
        drawn.append(spec)

    draw()
    return drawn


def test_fuzz_draws_no_variant_that_is_not_judged_yet():
    for spec in _drawn(60):
        assert refusal(spec) is None, refusal(spec)


def test_fuzz_draws_every_variant_once_judged(monkeypatch):
    from mhaspec.spec import variants

    monkeypatch.setattr(variants, "NOT_JUDGED_YET", frozenset())
    drawn = _drawn()
    used = {field for spec in drawn for field in variants.features(spec)}
    assert used == {"config.window_left", "config.window_right", "config.softcap", "config.alibi_slopes",
                    "config.sinks", "config.rope", "bias"}, used
    windows = [(spec.config.window_left, spec.src_len) for spec in drawn if spec.config.window_left is not None]
    assert any(w == 0 for w, _ in windows) and any(w >= S for w, S in windows), windows
    assert {s.config.rope.style for s in drawn if s.config.rope} == {"half", "interleaved"}
    assert any(s.config.rope.rotary_dim < s.config.D_k for s in drawn if s.config.rope)
    assert any(s.config.rope.query_offset or s.config.rope.key_offset for s in drawn if s.config.rope)
    assert {type(s.config.alibi_slopes) for s in drawn if s.config.alibi_slopes} == {str, tuple}
    assert any(not spec.config.has_variants and spec.bias is None for spec in drawn)  # and plain cases


def test_the_fast_reference_honours_a_window():
    from mhaspec.reference.fast import forward_fast

    spec = _spec("w_fast", window_left=1, window_right=0)
    x, w = spec.make_inputs(), spec.make_weights()
    fast, exact = forward_fast(spec.config, x, w), forward(spec.config, x, w)
    assert not fast.visible.all() and np.array_equal(fast.visible, visibility(spec.config, None, 2, 5, 7))
    assert np.all(np.abs(fast.stages["attn_weights"] - exact["attn_weights"]) <= fast.error["attn_weights"])


# -- the plain float64 operations the judge recomputes with (spec/variant_ops.py) ----------------------

@pytest.mark.parametrize("config", [
    {"rope": {"style": "half", "query_offset": 3, "key_offset": 1}},
    {"rope": {"style": "interleaved", "rotary_dim": 2, "theta": 500.0}, "num_kv_heads": 1},
    {"alibi_slopes": "standard", "causal": True, "causal_alignment": "bottom_right"},
    {"alibi_slopes": [0.5, 0.25], "softcap": 2.0},
])
def test_the_plain_variant_operations_agree_with_the_exact_reference_row_block_by_row_block(config):
    from mhaspec.reference import variants as exact
    from mhaspec.spec import variant_ops

    spec = CaseSpec(id="ops", config=MHAConfig(d_model=8, num_heads=2, **config), batch=2, tgt_len=5, src_len=7, seed=3)
    cfg, x = spec.config, spec.make_inputs()
    T, S = spec.tgt_len, spec.src_len
    s = np.random.default_rng(0).normal(size=(2, 2, T, S)) * 4
    if cfg.rope is not None:
        q = x["query"] @ spec.make_weights()["w_q"]
        q_pos, _ = exact.rope_positions(cfg, T, S)
        whole = exact.rope(q, cfg.H, q_pos, cfg)
        for t0, t1 in ((0, T), (2, 5), (4, 5)):
            pos, k_pos = variant_ops.rope_positions(cfg, t1 - t0, S, row_offset=t0)
            assert list(k_pos) == list(exact.rope_positions(cfg, T, S)[1])
            np.testing.assert_allclose(variant_ops.rope(q[:, t0:t1], cfg.H, pos, cfg), whole[:, t0:t1], rtol=0, atol=1e-14)
    if cfg.alibi_slopes is not None:
        whole = exact.add_bias(s, None, exact.alibi_slopes(cfg), exact.alibi_distance(cfg, T, S))
        for t0, t1 in ((0, T), (1, 4)):
            term = variant_ops.alibi(cfg, t1 - t0, S, T, row_offset=t0)
            np.testing.assert_allclose(s[:, :, t0:t1] + term[None], whole[:, :, t0:t1], rtol=1e-15, atol=1e-14)
    if cfg.softcap is not None:
        np.testing.assert_allclose(variant_ops.softcap(s, cfg.softcap), exact.softcap(s, cfg.softcap), rtol=4e-16, atol=0)


def test_backward_on_a_variant_fixture_is_asked_and_judged_on_what_it_returns():
    """A variant case's fixture holds its backward (docs/spec.md §2a): with --backward the adapter's
    backward is asked, a stage it returns is judged and the variants' gradients it does not return are
    not exposed; no "no backward golden" warning."""
    import mhaspec

    asked = []

    class PlainNumpy:  # every variant, in float64 (the plain implementation above)
        name = "plain-numpy"
        variants = frozenset({"window", "softcap", "alibi", "bias", "sinks", "rope"})

        def run(self, case):
            inputs = {"query": case.inputs.query, "key": case.inputs.key, "value": case.inputs.value,
                      "mask": case.inputs.mask, "bias": case.inputs.bias}
            weights = {name: getattr(case.weights, name) for name in
                       ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "sink_logits")}
            return {"output": naive_forward(case.config, inputs, {k: v for k, v in weights.items() if v is not None})["output"]}

        def backward(self, case):
            asked.append(case.id)
            return {"d_concat": case.d_output @ case.weights.w_o.T}  # (B, T, d_out) @ (d_out, H·D_v)

    report = mhaspec.check(PlainNumpy(), dtypes=["float64"], cases=["sinks", "rope_half"], backward=True,
                           timeout=None, isolate=False)
    assert asked == ["sinks", "rope_half"]
    for r in report.results:
        assert r.stage("d_concat").verdict == "pass", r.case
        variant_grads = {"sinks": ["d_sink_logits"], "rope_half": ["d_q_rot", "d_k_rot"]}[r.case]
        assert [r.stage(n).verdict for n in variant_grads] == ["not exposed"] * len(variant_grads)
    assert not [w for w in report.warnings if "no backward golden" in w]
