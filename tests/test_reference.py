"""The float64 reference: hand-checked values, an independent formulation, properties."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mhaspec.reference import forward, project, softmax, split_heads, visibility
from mhaspec.spec import CATALOG, MHAConfig
from mhaspec.spec.variants import variants_used

ALL = [s.id for s in CATALOG]
#: The cases without an attention variant (the variants' cases: tests/test_variant_spec.py).
PLAIN = [s.id for s in CATALOG if not variants_used(s)]


def test_project_by_hand():
    # x = [1, 2], w = arange(4).reshape(2, 2) = [[0, 1], [2, 3]], b = [1, -1]
    # y = [1*0 + 2*2 + 1, 1*1 + 2*3 - 1] = [5, 6]
    y = project(np.array([[[1.0, 2.0]]]), np.arange(4.0).reshape(2, 2), np.array([1.0, -1.0]))
    assert y.tolist() == [[[5.0, 6.0]]]


def test_split_heads_gives_head_h_columns_h_times_d():
    x = np.arange(12.0).reshape(1, 2, 6)  # B=1, L=2, H·D = 3·2
    heads = split_heads(x, 3)  # (1, 3, 2, 2)
    assert heads[0, 1].tolist() == [[2.0, 3.0], [8.0, 9.0]]  # head 1 owns columns 2..3


def test_tiny_layer_by_hand():
    # d_model=2, H=1, D=2, identity weights, no bias; one query, two keys.
    cfg = MHAConfig(d_model=2, num_heads=1, bias=False)
    eye = np.eye(2)
    inputs = {"query": np.array([[[1.0, 0.0]]]), "key": np.array([[[1.0, 0.0], [0.0, 1.0]]]),
              "value": np.array([[[2.0, 0.0], [0.0, 4.0]]])}
    st = forward(cfg, inputs, {"w_q": eye, "w_k": eye, "w_v": eye, "w_o": eye})
    # scores = [q·k0, q·k1] / sqrt(2) = [1/sqrt(2), 0]
    assert st["scores"][0, 0, 0].tolist() == [1 / math.sqrt(2), 0.0]
    # softmax: p0 = e^(1/sqrt2) / (e^(1/sqrt2) + 1), p1 = 1 / (e^(1/sqrt2) + 1)
    e = math.exp(1 / math.sqrt(2))
    np.testing.assert_allclose(st["attn_weights"][0, 0, 0], [e / (e + 1), 1 / (e + 1)], rtol=1e-15)
    # head output = p0·[2, 0] + p1·[0, 4]; identity W^O leaves it unchanged
    np.testing.assert_allclose(st["output"][0, 0], [2 * e / (e + 1), 4 / (e + 1)], rtol=1e-15)


def test_fully_masked_row_gives_zero_weights_and_output_b_o():
    cfg = MHAConfig(d_model=2, num_heads=1)
    w = {"w_q": np.eye(2), "w_k": np.eye(2), "w_v": np.eye(2), "w_o": np.eye(2),
         "b_q": np.zeros(2), "b_k": np.zeros(2), "b_v": np.ones(2), "b_o": np.array([0.5, -0.25])}
    x = np.array([[[1.0, 2.0], [3.0, -1.0]]])
    mask = np.array([[[[True, False], [False, False]]]])  # row 1 sees nothing
    st = forward(cfg, {"query": x, "key": x, "value": x, "mask": mask}, w)
    assert st["attn_weights"][0, 0, 1].tolist() == [0.0, 0.0]
    assert st["head_outputs"][0, 0, 1].tolist() == [0.0, 0.0]
    assert st["output"][0, 1].tolist() == [0.5, -0.25]
    assert st["attn_weights"][0, 0, 0].tolist() == [1.0, 0.0]


def test_softmax_is_stable_for_huge_scores():
    s = np.array([[[[1000.0, 999.0, -1000.0]]]])
    p = softmax(s, np.ones_like(s, dtype=bool))
    e = math.exp(-1)
    np.testing.assert_allclose(p[0, 0, 0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-15, atol=1e-300)


@pytest.mark.parametrize(("align", "expected"), [
    ("top_left", [[1, 0, 0, 0], [1, 1, 0, 0]]),      # j <= i
    ("bottom_right", [[1, 1, 1, 0], [1, 1, 1, 1]]),  # j <= i + S - T = i + 2
])
def test_causal_alignment_on_a_rectangular_case(align, expected):
    cfg = MHAConfig(d_model=2, num_heads=1, causal=True, causal_alignment=align)
    assert visibility(cfg, None, 1, 2, 4)[0, 0].astype(int).tolist() == expected


def test_causal_and_mask_combine_by_and():
    cfg = MHAConfig(d_model=2, num_heads=1, causal=True)
    mask = np.array([True, False, True]).reshape(1, 1, 1, 3)
    assert visibility(cfg, mask, 1, 3, 3)[0, 0].astype(int).tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 1]]


def _independent(spec):
    """Every stage with an explicit per-head loop and einsum (plain float64, numpy sums)."""
    cfg, x, w = spec.config, spec.make_inputs(), spec.make_weights()
    z = {k: w.get(k, 0.0) for k in ("b_q", "b_k", "b_v", "b_o")}
    q = np.einsum("btf,fn->btn", x["query"], w["w_q"]) + z["b_q"]
    k = np.einsum("bsf,fn->bsn", x["key"], w["w_k"]) + z["b_k"]
    v = np.einsum("bsf,fn->bsn", x["value"], w["w_v"]) + z["b_v"]
    B, T, S = spec.batch, spec.tgt_len, spec.src_len
    Dk, Dv = cfg.D_k, cfg.D_v
    s = np.zeros((B, cfg.H, T, S))
    p = np.zeros_like(s)
    o = np.zeros((B, cfg.H, T, Dv))
    for h in range(cfg.H):
        g = h // (cfg.H // cfg.H_kv)
        qh = q[:, :, h * Dk:(h + 1) * Dk]
        kh = k[:, :, g * Dk:(g + 1) * Dk]
        vh = v[:, :, g * Dv:(g + 1) * Dv]
        s[:, h] = np.einsum("btd,bsd->bts", qh, kh) * cfg.scale
        for b in range(B):
            for t in range(T):
                seen = [j for j in range(S)
                        if (not cfg.causal or j <= t + (0 if cfg.causal_alignment == "top_left" else S - T))
                        and ("mask" not in x or x["mask"][b, 0, min(t, x["mask"].shape[2] - 1), j])]
                if seen:
                    ex = np.exp(s[b, h, t, seen] - s[b, h, t, seen].max())
                    p[b, h, t, seen] = ex / ex.sum()
        o[:, h] = np.einsum("bts,bse->bte", p[:, h], vh)
    c = np.concatenate([o[:, h] for h in range(cfg.H)], axis=-1)
    y = c @ w["w_o"] + z["b_o"]
    return {"q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p,
            "head_outputs": o, "concat": c, "output": y}


@pytest.mark.parametrize("case_id", PLAIN)
def test_reference_matches_an_independent_formulation(case_id):
    spec = CATALOG[case_id]
    ref = forward(spec.config, spec.make_inputs(), spec.make_weights())
    ind = _independent(spec)
    for name, value in ind.items():
        scale = max(1.0, float(np.abs(value).max()))
        np.testing.assert_allclose(ref[name], value, rtol=1e-12, atol=1e-13 * scale, err_msg=f"{case_id}.{name}")


@pytest.mark.parametrize("case_id", ALL)
def test_attention_rows_sum_to_one_or_zero(case_id):
    spec = CATALOG[case_id]
    x = spec.make_inputs()
    p = forward(spec.config, x, spec.make_weights())["attn_weights"]
    vis = visibility(spec.config, x.get("mask"), spec.batch, spec.tgt_len, spec.src_len)
    any_visible = vis.any(axis=-1)
    sums = p.sum(axis=-1)
    if spec.config.sinks:  # the sink takes its share e^sink / (Σ e^s + e^sink) of each row
        assert np.all((sums[any_visible] > 0) & (sums[any_visible] < 1))
    else:
        np.testing.assert_allclose(sums[any_visible], 1.0, rtol=1e-14)
    assert np.all(sums[~any_visible] == 0) and np.all(p[~vis] == 0)


def test_catalog_has_fully_masked_rows_and_their_output_is_b_o():
    for case_id in ("custom_mask", "causal_bottom_right_t_gt_s", "key_padding"):
        spec = CATALOG[case_id]
        x, w = spec.make_inputs(), spec.make_weights()
        st = forward(spec.config, x, w)
        vis = visibility(spec.config, x.get("mask"), spec.batch, spec.tgt_len, spec.src_len)
        blind = ~vis.any(axis=-1)  # (B, H, T)
        if case_id == "key_padding":
            assert not blind.any()
            continue
        assert blind.any()
        b, t = np.argwhere(blind[:, 0])[0]
        assert st["output"][b, t].tolist() == w["b_o"].tolist()


def test_gqa_equals_mha_with_repeated_kv_heads():
    spec = CATALOG["gqa"]
    cfg, x, w = spec.config, spec.make_inputs(), spec.make_weights()
    group, Dk = cfg.group_size, cfg.D_k
    rep = lambda m: np.concatenate([m[..., g * Dk:(g + 1) * Dk] for g in range(cfg.H_kv) for _ in range(group)], -1)
    mha_cfg = type(cfg)(**{**cfg.model_dump(), "num_kv_heads": cfg.H})
    w_mha = {**w, "w_k": rep(w["w_k"]), "w_v": rep(w["w_v"]), "b_k": rep(w["b_k"]), "b_v": rep(w["b_v"])}
    a, b = forward(cfg, x, w), forward(mha_cfg, x, w_mha)
    for name in ("scores", "attn_weights", "head_outputs", "concat", "output"):
        assert np.array_equal(a[name], b[name]), name


def test_scale_is_applied_once():
    spec = CATALOG["custom_scale"]  # scale = 1/8
    x, w = spec.make_inputs(), spec.make_weights()
    one = type(spec.config)(**{**spec.config.model_dump(), "scale": 1.0})
    s8 = forward(spec.config, x, w)["scores"]
    s1 = forward(one, x, w)["scores"]
    assert np.array_equal(s8 * 8, s1)  # powers of two: exact
