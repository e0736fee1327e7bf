"""The exact backward reference of the attention variants (docs/backward.md "The variants"): against
torch float64 autograd of an independent forward on every variant catalog case and a few cases that
combine the variants, and its own pieces (softcap′ correctly rounded, RoPE turned back = Rᵀ, d_bias
summed over the broadcast axes)."""

from __future__ import annotations

from decimal import Context, Decimal

import numpy as np
import pytest

from tests.conftest import require

from mhaspec.reference import backward, forward
from mhaspec.reference import rounding
from mhaspec.reference import variants as exact
from mhaspec.spec import CATALOG, CaseSpec, MHAConfig
from mhaspec.spec.masks import visibility
from mhaspec.spec.stages import BACKWARD_VARIANT_STAGES
from mhaspec.spec.variants import standard_alibi_slopes, variants_used

#: Cases that combine the variants beyond the catalog: GQA with partial interleaved RoPE, softcap, a
#: per-batch bias and sinks; T > S bottom-right with a window (rows that see no key) and a sink; ALiBi
#: with a shared bias and softcap.
COMBINED = [
    CaseSpec(id="gqa_rope_softcap_bias_sinks", batch=2, tgt_len=5, src_len=6, seed=7, bias={"per_batch": True},
             config=MHAConfig(d_model=12, num_heads=4, num_kv_heads=2, head_dim=6, softcap=1.25, sinks=True,
                              rope={"style": "interleaved", "rotary_dim": 4, "query_offset": 2, "theta": 40.0})),
    CaseSpec(id="t_gt_s_window_sink", batch=2, tgt_len=7, src_len=4, seed=8, inputs="distinct",
             config=MHAConfig(d_model=10, num_heads=2, head_dim=5, causal=True, causal_alignment="bottom_right",
                              window_left=1, sinks=True, rope={"theta": 20.0, "rotary_dim": 4})),
    CaseSpec(id="alibi_shared_bias_softcap", batch=3, tgt_len=4, src_len=6, seed=9, bias={"per_head": False},
             config=MHAConfig(d_model=9, num_heads=3, head_dim=3, alibi_slopes="standard", softcap=0.5,
                              causal=True, causal_alignment="bottom_right")),
]
CASES = {spec.id: spec for spec in [*(s for s in CATALOG if variants_used(s)), *COMBINED]}

#: Relative agreement asked of every stage (the largest seen is in the test's failure message; the
#: figure at the time of writing: benchmarks/results/2026-12-06-variant-backward-golden.md).
AGREEMENT = 1e-13


def exact_stages(spec: CaseSpec) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the exact forward stages, the exact backward stages) of ``spec``."""
    inputs, weights = spec.make_inputs(), spec.make_weights()
    stages = forward(spec.config, inputs, weights)
    visible = visibility(spec.config, inputs.get("mask"), spec.batch, spec.tgt_len, spec.src_len)
    return stages, backward(spec.config, inputs, weights, stages, visible, spec.make_d_output(), spec.inputs)


def torch_gradients(spec: CaseSpec) -> dict[str, np.ndarray]:
    """Every backward stage of ``spec`` by torch float64 autograd of a forward written here (torch's
    cos, sin, tanh, exp; not correctly rounded), with the taps each stage is the gradient of."""
    torch = require("torch")
    cfg, inputs, weights = spec.config, spec.make_inputs(), spec.make_weights()
    B, T, S, H, G, D, E = spec.batch, spec.tgt_len, spec.src_len, cfg.H, cfg.H_kv, cfg.D_k, cfg.D_v

    def leaf(a):
        return torch.tensor(np.array(a), dtype=torch.float64, requires_grad=True)

    x = {k: leaf(v) for k, v in inputs.items() if k in ("query", "key", "value") and v is not None}
    if spec.inputs == "self":
        x["key"] = x["value"] = x["query"]
    elif spec.inputs == "shared_kv":
        x["value"] = x["key"]
    w = {k: leaf(v) for k, v in weights.items()}
    bias = leaf(inputs["bias"]) if inputs.get("bias") is not None else None

    def lin(a, n):
        return a @ w[f"w_{n}"] + (w[f"b_{n}"] if f"b_{n}" in w else 0)

    def turn(a, heads, positions):  # RoPE: pair (a, b) -> (a·cos − b·sin, b·cos + a·sin)
        r = cfg.rope.rotary_dim
        pairs = (np.arange(r // 2), np.arange(r // 2) + r // 2) if cfg.rope.style == "half" else \
            (np.arange(0, r, 2), np.arange(1, r, 2))
        angle = torch.tensor(positions, dtype=torch.float64)[:, None] * \
            cfg.rope.theta ** (-2.0 * torch.arange(r // 2, dtype=torch.float64) / r)  # (L, r/2)
        c, s = torch.cos(angle)[None, :, None], torch.sin(angle)[None, :, None]
        h = a.reshape(B, len(positions), heads, D)
        first, second = h[..., pairs[0]], h[..., pairs[1]]
        out = h.clone()
        out[..., pairs[0]] = first * c - second * s
        out[..., pairs[1]] = second * c + first * s
        return out.reshape(B, len(positions), heads * D)

    q, k, v = lin(x["query"], "q"), lin(x["key"], "k"), lin(x["value"], "v")
    q_att, k_att = q, k
    if cfg.rope is not None:
        q_att = turn(q, H, cfg.rope.query_offset + np.arange(T))
        k_att = turn(k, G, cfg.rope.key_offset + np.arange(S))
    Q = q_att.view(B, T, H, D).transpose(1, 2)
    K = k_att.view(B, S, G, D).transpose(1, 2).repeat_interleave(H // G, 1)
    V = v.view(B, S, G, E).transpose(1, 2).repeat_interleave(H // G, 1)
    s = Q @ K.transpose(-1, -2) * cfg.scale
    if cfg.softcap is not None:
        s = cfg.softcap * torch.tanh(s / cfg.softcap)
    if bias is not None:
        s = s + bias
    if cfg.alibi_slopes is not None:
        slopes = standard_alibi_slopes(H) if cfg.alibi_slopes == "standard" else cfg.alibi_slopes
        off = 0 if cfg.causal_alignment == "top_left" else S - T
        distance = np.abs(np.arange(T)[:, None] + off - np.arange(S)[None, :])
        s = s - torch.tensor(np.array(slopes)[:, None, None] * distance)
    logits = s
    vis = torch.tensor(visibility(cfg, inputs.get("mask"), B, T, S))
    seen = vis.any(-1, keepdim=True)  # (B, H, T, 1)
    z = s.masked_fill(~vis, -torch.inf)
    if cfg.sinks:
        z = torch.cat([z, w["sink_logits"][None, :, None, None].expand(B, H, T, 1)], -1)
    z = torch.where(seen, z, 0.0)  # a row that sees no key: softmax of zeros, then multiplied by 0
    p = (torch.softmax(z, -1)[..., :S] * seen).masked_fill(~vis, 0)
    o = p @ V
    c = o.transpose(1, 2).reshape(B, T, H * E)
    taps = {"d_q_proj": q, "d_k_proj": k, "d_v_proj": v, "d_scores": logits, "d_attn_weights": p,
            "d_head_outputs": o, "d_concat": c}
    if cfg.rope is not None:
        taps.update(d_q_rot=q_att, d_k_rot=k_att)
    for t in taps.values():
        t.retain_grad()
    lin(c, "o").backward(torch.tensor(spec.make_d_output()))
    got = {name: t.grad for name, t in taps.items()}
    got["d_attn_weights"] = got["d_attn_weights"] * vis
    got["d_query"] = x["query"].grad
    if spec.inputs != "self":
        got["d_key"] = x["key"].grad
    if spec.inputs == "distinct":
        got["d_value"] = x["value"].grad
    got.update({f"d_{n}": w[n].grad for n in w})
    if bias is not None:
        got["d_bias"] = bias.grad
    return {name: value.detach().numpy() for name, value in got.items()}


def relative_error(name: str, got: np.ndarray, grads: dict[str, np.ndarray]) -> float:
    """max |got − exact| over max |exact| (d_b_k, ~0 by the softmax's shift invariance: over d_k_proj's)."""
    scale = np.abs(grads["d_k_proj" if name == "d_b_k" else name]).max()
    return float(np.abs(got - grads[name]).max() / max(scale, 1e-300))


@pytest.mark.torch
@pytest.mark.parametrize("case_id", list(CASES))
def test_the_exact_backward_agrees_with_torch_float64_autograd(case_id):
    spec = CASES[case_id]
    _, grads = exact_stages(spec)
    want = torch_gradients(spec)
    assert set(want) == set(grads), sorted(set(want) ^ set(grads))
    assert set(BACKWARD_VARIANT_STAGES) & set(grads) == {
        n for n, on in (("d_q_rot", spec.config.rope), ("d_k_rot", spec.config.rope),
                        ("d_sink_logits", spec.config.sinks), ("d_bias", spec.bias)) if on}
    errors = {name: relative_error(name, want[name], grads) for name in grads}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= AGREEMENT, f"{case_id}: {worst} {errors[worst]:.3g} > {AGREEMENT:g} ({errors})"


# -- the pieces --------------------------------------------------------------------------------------

def test_softcap_slope_rounds_correctly_against_an_independent_formula_at_300_digits():
    """1 − tanh²(u), u = x/c, as 1 − ((e^2u − 1)/(e^2u + 1))² at 300 digits more than the cancellation
    costs (2|u| / ln 10 < |u| digits), rounded once."""
    rng = np.random.default_rng(5)
    points = (rng.standard_normal(400) * 10.0 ** rng.integers(-8, 3, 400)).tolist() + [0.0, -0.0, 1e-300, 700.0]
    for x in points:
        for cap in (1.0, 30.0, 0.375):
            ctx = Context(prec=300 + int(abs(x / cap)))
            e = ctx.exp(ctx.multiply(2, ctx.divide(Decimal(x), Decimal(cap))))
            tanh = ctx.divide(ctx.subtract(e, 1), ctx.add(e, 1))
            assert rounding.softcap_slope(x, cap) == float(ctx.subtract(1, ctx.multiply(tanh, tanh))), (x, cap)


def test_rope_turned_back_is_the_transpose_of_the_turn():
    """⟨R x, y⟩ = ⟨x, Rᵀ y⟩ (to float64 rounding), and features past rotary_dim pass through untouched."""
    cfg = COMBINED[0].config
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((2, 5, cfg.H * cfg.D_k)), rng.standard_normal((2, 5, cfg.H * cfg.D_k))
    positions = cfg.rope.query_offset + np.arange(5)
    turned, back = exact.rope(x, cfg.H, positions, cfg), exact.rope(y, cfg.H, positions, cfg, back=True)
    assert abs(np.sum(turned * y) - np.sum(x * back)) <= 1e-13 * np.sum(np.abs(x) * np.abs(y))
    np.testing.assert_allclose(exact.rope(turned, cfg.H, positions, cfg, back=True), x, rtol=0, atol=1e-14)
    rest = np.arange(cfg.H * cfg.D_k).reshape(cfg.H, cfg.D_k)[:, cfg.rope.rotary_dim:].ravel()
    assert np.array_equal(back[..., rest], y[..., rest]) and not np.array_equal(back, y)


@pytest.mark.parametrize("bias_shape", [(2, 3, 4, 5), (1, 3, 4, 5), (2, 1, 4, 5), (1, 1, 4, 5)])
def test_d_bias_sums_d_scores_over_the_axes_the_bias_broadcasts(bias_shape):
    dS = np.random.default_rng(4).standard_normal((2, 3, 4, 5))  # (B, H, T, S)
    summed = tuple(axis for axis in (0, 1) if bias_shape[axis] == 1)
    got = exact.d_bias(dS, bias_shape)
    assert got.shape == bias_shape
    np.testing.assert_allclose(got, dS.sum(axis=summed, keepdims=True), rtol=1e-15, atol=1e-15)
