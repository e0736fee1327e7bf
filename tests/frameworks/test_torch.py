"""The PyTorch adapters: converters, mask polarity, supports() reasons, conformance, and the
attention variants (docs/spec.md §2a) of ``torch``, ``torch-sdpa`` and ``torch-flex``."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import (GOLDEN, arange_weights, assert_decode_matches_run, assert_same_weights, check_here,
                                      decode_specs, golden_case)

torch = require("torch")

import mhaspec  # noqa: E402
from mhaspec.adapters import torch_flex, torch_layer, torch_mha, torch_sdpa  # noqa: E402
from mhaspec.adapters.backends import torch as backend  # noqa: E402
from mhaspec.adapters.backends.torch import keep_mask  # noqa: E402
from mhaspec.protocol.loading import load_adapter  # noqa: E402
from mhaspec.reference import forward  # noqa: E402
from mhaspec.reference.onthefly import OnTheFlyGolden  # noqa: E402
from mhaspec.spec import CaseSpec, MHAConfig  # noqa: E402
from mhaspec.spec.stages import forward_stages  # noqa: E402
from mhaspec.spec.variants import undeclared, variants_used  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]


# -- converters ---------------------------------------------------------------


@pytest.mark.parametrize("module", [torch_layer, torch_sdpa], ids=["torch", "torch-sdpa"])
@pytest.mark.parametrize("case_id", ["custom_head_dims", "gqa", "cross_attention", "no_bias"])
def test_linear_converters_round_trip_through_a_real_module(module, case_id: str) -> None:
    case = golden_case(case_id)
    net = (
        torch_layer.MultiHeadAttention.from_config(case.config, dtype=torch.float64)
        if module is torch_layer
        else torch_sdpa.SDPAMultiHeadAttention(case.config, dtype=torch.float64)
    )
    net.load_state_dict(module.canonical_to_state_dict(case.weights))  # strict: the keys are the module's
    assert_same_weights(module.state_dict_to_canonical(net.state_dict()), case.weights.as_dict())


@pytest.mark.parametrize("case_id", ["self_basic", "cross_attention", "no_bias", "head_dim_1"])
def test_mha_converters_round_trip_through_nn_multihead_attention(case_id: str) -> None:
    case = golden_case(case_id)
    cfg = case.config
    mha = torch.nn.MultiheadAttention(
        embed_dim=cfg.d_model, num_heads=cfg.H, bias=cfg.bias, kdim=cfg.kdim, vdim=cfg.vdim,
        batch_first=True, dtype=torch.float64,
    )
    state = torch_mha.canonical_to_state_dict(case.weights)
    assert ("in_proj_weight" in state) == (cfg.kdim == cfg.vdim == cfg.d_model)
    mha.load_state_dict(state)  # strict
    assert_same_weights(torch_mha.state_dict_to_canonical(mha.state_dict()), case.weights.as_dict())


def test_linear_layout_by_hand() -> None:
    cfg = MHAConfig(d_model=2, num_heads=1, kdim=3, vdim=1, value_head_dim=3, out_dim=4, head_dim=5)
    w = arange_weights(cfg)  # w_q (2, 5), w_k (3, 5), w_v (1, 3), w_o (3, 4)
    state = torch_layer.canonical_to_state_dict(w)
    np.testing.assert_array_equal(state["q_proj.weight"].numpy(), [[0, 5], [1, 6], [2, 7], [3, 8], [4, 9]])
    np.testing.assert_array_equal(state["v_proj.weight"].numpy(), [[200], [201], [202]])
    np.testing.assert_array_equal(state["out_proj.bias"].numpy(), [700, 701, 702, 703])
    # nn.Linear computes x @ weight.T + bias = x @ w_q + b_q
    linear = torch.nn.Linear(2, 5, dtype=torch.float64)
    linear.load_state_dict({"weight": state["q_proj.weight"], "bias": state["q_proj.bias"]})
    y = linear(torch.tensor([[1.0, 10.0]], dtype=torch.float64)).detach().numpy()
    np.testing.assert_array_equal(y, [[50 + 400, 61 + 401, 72 + 402, 83 + 403, 94 + 404]])


def test_mha_packed_layout_by_hand() -> None:
    cfg = MHAConfig(d_model=2, num_heads=2)
    w = arange_weights(cfg)  # w_q = [[0, 1], [2, 3]], w_k = w_q + 100, w_v = w_q + 200
    state = torch_mha.canonical_to_state_dict(w)
    assert set(state) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    np.testing.assert_array_equal(  # (3·d_model, d_model): rows q, k, v, each block W.T
        state["in_proj_weight"].numpy(), [[0, 2], [1, 3], [100, 102], [101, 103], [200, 202], [201, 203]]
    )
    np.testing.assert_array_equal(state["in_proj_bias"].numpy(), [400, 401, 500, 501, 600, 601])
    np.testing.assert_array_equal(state["out_proj.weight"].numpy(), [[300, 302], [301, 303]])


def test_mha_separate_layout_by_hand() -> None:
    cfg = MHAConfig(d_model=2, num_heads=1, kdim=3, vdim=1, bias=False)
    state = torch_mha.canonical_to_state_dict(arange_weights(cfg))
    assert set(state) == {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}
    np.testing.assert_array_equal(state["k_proj_weight"].numpy(), [[100, 102, 104], [101, 103, 105]])  # (d_model, kdim)
    np.testing.assert_array_equal(state["v_proj_weight"].numpy(), [[200], [201]])  # (d_model, vdim)


# -- masks ------------------------------------------------------------------


def test_key_padding_becomes_torch_key_padding_mask() -> None:
    kwargs = torch_mha.torch_masks(golden_case("key_padding"), "cpu")  # lengths 7, 4, 1
    assert set(kwargs) == {"key_padding_mask"}
    blocked = kwargs["key_padding_mask"]  # True = ignore this key
    assert blocked.dtype == torch.bool and blocked.shape == (3, 7)
    assert blocked.sum(dim=1).tolist() == [0, 3, 6]
    assert blocked[1].tolist() == [False] * 4 + [True] * 3


def test_random_mask_becomes_blocked_per_head_attn_mask() -> None:
    case = golden_case("custom_mask")
    kwargs = torch_mha.torch_masks(case, "cpu")
    B, H, T, S = case.batch, case.config.H, case.tgt_len, case.src_len
    assert set(kwargs) == {"attn_mask", "is_causal"} and kwargs["is_causal"] is False
    expected = ~np.broadcast_to(case.inputs.mask, (B, H, T, S)).reshape(B * H, T, S)
    np.testing.assert_array_equal(kwargs["attn_mask"].numpy(), expected)


def test_bottom_right_causal_polarity_by_hand() -> None:
    # causal_bottom_right_t_gt_s: T=7, S=4, bottom-right: query i sees keys j <= i - 3
    case = golden_case("causal_bottom_right_t_gt_s")
    kwargs = torch_mha.torch_masks(case, "cpu")
    assert kwargs["is_causal"] is False  # torch's hint means top-left: it must not be given here
    blocked = kwargs["attn_mask"]
    assert blocked.shape == (7, 4)
    assert blocked[:3].all()  # the first T - S rows see no key
    assert blocked[3].tolist() == [False, True, True, True]
    assert not blocked[6].any()
    allowed = keep_mask(case, "cpu")  # SDPA polarity: True = take part
    assert torch.equal(allowed[0, 0], ~blocked)


def test_plain_top_left_causal_uses_is_causal_hint() -> None:
    kwargs = torch_mha.torch_masks(golden_case("causal_top_left"), "cpu")  # T=5 < S=8
    assert kwargs["is_causal"] is True
    assert kwargs["attn_mask"][0].tolist() == [False] + [True] * 7


def test_module_zeroes_masked_weights_and_rows_without_keys() -> None:
    net = torch_layer.MultiHeadAttention(d_model=6, num_heads=3, kdim=5, vdim=7, dtype=torch.float64)
    query = torch.randn(2, 4, 6, dtype=torch.float64)
    key, value = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 7, dtype=torch.float64)
    mask = torch.ones(2, 1, 4, 3, dtype=torch.bool)
    mask[0, 0, 1] = False  # batch 0, query 1 sees no key
    mask[1, 0, :, 2] = False  # batch 1 never sees key 2
    with torch.no_grad():
        stages = net(query, key, value, mask=mask, return_stages=True)
        assert torch.equal(net(query, key, value, mask=mask), stages["output"])
    p = stages["attn_weights"]
    assert p.shape == (2, 3, 4, 3) and not p.isnan().any()
    assert (p[0, :, 1] == 0).all() and (stages["head_outputs"][0, :, 1] == 0).all()
    assert torch.equal(stages["output"][0, 1], net.out_proj.bias)
    assert (p[1, ..., 2] == 0).all()
    torch.testing.assert_close(p.sum(-1)[1], torch.ones(3, 4, dtype=torch.float64))


# -- supports() and construction ----------------------------------------------


@pytest.mark.parametrize(
    ("case_id", "reason"),
    [
        ("gqa", "grouped-query"),
        ("mqa", "grouped-query"),
        ("custom_head_dims", "head_dim = d_model / H"),
        ("custom_scale", "no scale argument"),
        ("cross_attention", None),
        ("no_bias", None),
        ("causal_bottom_right_t_gt_s", None),
    ],
)
def test_mha_supports_reasons(case_id: str, reason: str | None) -> None:
    for adapter in (torch_mha.TorchMultiheadAttentionAdapter(), torch_mha.TorchMultiheadAttentionFastAdapter()):
        answer = adapter.supports(golden_case(case_id))
        if reason is None:
            assert answer is True
        else:
            assert isinstance(answer, str) and reason in answer


def test_layer_and_sdpa_support_every_catalog_case() -> None:
    for case_id in GOLDEN.ids():
        assert torch_sdpa.TorchSDPAAdapter().supports(golden_case(case_id)) is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_is_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        torch_layer.TorchMHAAdapter(device="cuda")


# -- conformance (the whole catalog: tests/frameworks/test_catalog_runs.py) ----------


def test_torch_exposes_every_stage_and_sdpa_the_unfused_ones() -> None:
    report = check_here("torch", dtypes=["float32"], cases=["gqa"])
    assert all(st.verdict == "pass" for st in report.result("gqa", "float32").stages)
    report = check_here("torch-sdpa", dtypes=["float32"], cases=["gqa"])
    verdicts = {st.stage: st.verdict for st in report.result("gqa", "float32").stages}
    assert verdicts["scores"] == verdicts["attn_weights"] == "not exposed"
    assert verdicts["head_outputs"] == verdicts["output"] == "pass"


def test_mha_nan_on_rows_without_keys_is_a_declared_deviation() -> None:
    # If this fails because the stages pass, PyTorch fixed #41508: drop the declaration.
    report = check_here("torch-mha", dtypes=["float32"], cases=["custom_mask"])
    stages = {st.stage: st.verdict for st in report.result("custom_mask", "float32").stages}
    assert stages["attn_weights"] == stages["output"] == "known deviation"
    fast = check_here("torch-mha-fast", dtypes=["float32"], cases=["custom_mask"])
    assert fast.result("custom_mask", "float32").verdict == "pass"  # need_weights=False goes through SDPA


def test_user_example_adapter_conforms() -> None:
    report = mhaspec.check(f"{ROOT / 'examples' / 'torch_adapter.py'}:MyTorchMHA", dtypes=["float64", "float16"],
                           cases=["self_basic", "key_padding", "cross_attention"])
    assert report.ok, str(report)
    assert report.result("cross_attention", "float16").verdict == "unsupported"
    assert report.result("key_padding", "float64").verdict == "pass"


#: kernel-shaped cases of the built-in catalog `kernels` (issue 35): SDPA's is_causal at T = S, its
#: bottom-right causal mask at T != S, enable_gqa, key padding, head_dim 256
KERNEL_CASES = ["k_d64_t256_causal_br", "k_fa_113_203_causal_br", "k_gqa_d64_t128", "k_d64_t128_padding", "k_d256_t64"]


def test_sdpa_conforms_on_kernel_shaped_cases() -> None:
    report = check_here("torch-sdpa", golden=OnTheFlyGolden("kernels"), cases=KERNEL_CASES)
    assert report.ok, str(report)
    assert {r.verdict for r in report.results} == {"pass"} and len(report.results) == 4 * len(KERNEL_CASES)


# -- the attention variants (docs/spec.md §2a) ---------------------------------------------------


def _spec(case_id: str, config: dict, **fields) -> CaseSpec:
    """A variant case with sizes that all differ (d_model 10, kdim 7, vdim 5, D_k 6, D_v 4, d_out 9)."""
    sizes = {"d_model": 10, "kdim": 7, "vdim": 5, "head_dim": 6, "value_head_dim": 4, "out_dim": 9}
    return CaseSpec(id=case_id, config=MHAConfig(**{**sizes, **config}), **{"batch": 2, "seed": 11, **fields})


#: One case per variant and the combinations models ship, with rows that see no key where a mask allows.
VARIANT_SPECS = [
    _spec("window_gqa_bottom_right", {"num_heads": 4, "num_kv_heads": 2, "causal": True,
                                      "causal_alignment": "bottom_right", "window_left": 2, "window_right": 0},
          tgt_len=5, src_len=8),
    _spec("window_both_sides_t_gt_s", {"num_heads": 3, "causal_alignment": "bottom_right", "window_left": 1,
                                       "window_right": 1}, tgt_len=8, src_len=5),  # rows 0..1 see no key
    _spec("window_right_only_shared_kv", {"num_heads": 2, "window_right": 2, "kdim": 7, "vdim": 7},
          tgt_len=6, src_len=5, inputs="shared_kv"),  # i <= j <= i + 2: the last rows see fewer keys
    _spec("softcap_window", {"num_heads": 3, "causal": True, "softcap": 0.75, "window_left": 3},
          tgt_len=6, src_len=6, weight_shift=2),  # large logits: the cap bites
    _spec("alibi_bias_both_sides", {"num_heads": 3, "alibi_slopes": "standard"}, tgt_len=5, src_len=7,
          bias={"per_batch": True, "per_head": True}),
    _spec("alibi_causal_shared_bias", {"num_heads": 2, "causal": True, "causal_alignment": "bottom_right",
                                       "alibi_slopes": [0.5, 0.125]}, tgt_len=4, src_len=7,
          bias={"per_head": False}),
    _spec("sinks_window_masked_rows", {"num_heads": 3, "sinks": True, "window_left": 2, "window_right": 1},
          tgt_len=6, src_len=7, mask={"kind": "random", "fully_masked": [[0, 1], [1, 4]]}),
    _spec("rope_half_partial_gqa", {"num_heads": 4, "num_kv_heads": 1, "causal": True,
                                    "rope": {"rotary_dim": 4, "query_offset": 5, "key_offset": 2}},
          tgt_len=5, src_len=6),
    _spec("rope_interleaved", {"num_heads": 2, "rope": {"style": "interleaved", "theta": 500.0}},
          tgt_len=6, src_len=4, inputs="distinct"),
    _spec("everything", {"num_heads": 4, "num_kv_heads": 2, "causal": True, "causal_alignment": "bottom_right",
                         "window_left": 3, "softcap": 2.0, "alibi_slopes": "standard", "sinks": True,
                         "rope": {"style": "interleaved", "rotary_dim": 2, "query_offset": 1}},
          tgt_len=5, src_len=7, bias={}, mask={"kind": "key_padding", "lengths": [7, 3]}),
]
VARIANT_ADAPTERS = ["torch", "torch-sdpa", "torch-flex"]

#: What each adapter returns besides q_proj, k_proj, v_proj (and q_rot, k_rot with RoPE), head_outputs, concat
#: and output: the hand-written module every stage, SDPA nothing more, Flex the log-sum-exp.
EXTRA_STAGES = {"torch": {"scores", "attn_weights", "lse"}, "torch-sdpa": set(), "torch-flex": {"lse"}}


@functools.cache
def _exact(case_id: str) -> dict[str, np.ndarray]:
    spec = next(s for s in VARIANT_SPECS if s.id == case_id)
    return forward(spec.config, spec.make_inputs(), spec.make_weights())


def _assert_close(name: str, got: np.ndarray, want: np.ndarray, visible: np.ndarray, rel: float) -> None:
    """``got`` within rel · max(1, max |want|) of ``want`` on the entries the spec compares (scores: the
    visible ones), and exactly −inf where ``want`` is (lse of a row that sees no key)."""
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if name == "scores":
        got, want = got[visible], want[visible]
    infinite = np.isinf(want)
    np.testing.assert_array_equal(got[infinite], want[infinite], err_msg=name)
    scale = max(1.0, float(np.abs(want[~infinite]).max(initial=0.0)))
    np.testing.assert_allclose(got[~infinite], want[~infinite], rtol=0, atol=rel * scale, err_msg=name)


@pytest.mark.parametrize("spec", VARIANT_SPECS, ids=lambda s: s.id)
@pytest.mark.parametrize("name", VARIANT_ADAPTERS)
@pytest.mark.parametrize(("dtype", "rel"), [
    # float64: each stage is a few roundings of sums of at most 9 terms of magnitude <= the scale: far below
    # 1e-13 of it (the worst seen is 2e-15); any variant applied wrongly moves an entry by far more
    ("float64", 1e-13),
    # float32: the same at u = 6e-8 (RoPE's angles in float32 as HF makes them: position <= 12, so the angle
    # is off by <= 12·u; float32 softmax, lse and tanh): within 1e-5 of the scale
    ("float32", 1e-5),
])
def test_variants_match_the_exact_reference(name: str, spec: CaseSpec, dtype: str, rel: float) -> None:
    adapter = load_adapter(name)
    why = undeclared(spec, adapter.variants)
    if "softcap" in variants_used(spec) and name == "torch-sdpa":
        assert why is not None and "softcap" in why  # reported unsupported, naming softcap: never run
        return
    assert why is None
    case = spec.case(dtype)
    got = adapter.run(case)
    common = {"q_proj", "k_proj", "v_proj", "head_outputs", "concat", "output"}
    rope = {"q_rot", "k_rot"} if spec.config.rope is not None else set()
    assert set(got) == common | rope | EXTRA_STAGES[name]
    assert set(got) <= set(forward_stages(spec.config))
    exact, visible = _exact(spec.id), case.visible
    for stage, value in got.items():
        _assert_close(stage, np.asarray(value, dtype=np.float64), exact[stage], visible, rel)


@pytest.mark.parametrize("name", VARIANT_ADAPTERS)
def test_variants_give_no_nan_in_half_precision(name: str) -> None:
    spec = next(s for s in VARIANT_SPECS if s.id == "sinks_window_masked_rows")
    for dtype in ("float16", "bfloat16"):
        got = load_adapter(name).run(spec.case(dtype))
        assert not any(np.isnan(np.asarray(v, dtype=np.float64)).any() for v in got.values()), (name, dtype)
        concat = np.asarray(got["concat"], dtype=np.float64)
        assert (concat[0, 1] == 0).all() and (concat[1, 4] == 0).all()  # rows that see no key: zeros, sink or not


#: the backward stages SDPA cannot expose: it is fused, so d_attn_weights and d_scores stay inside
SDPA_HIDDEN_GRADIENTS = {"d_attn_weights", "d_scores"}


@pytest.mark.parametrize("spec", VARIANT_SPECS, ids=lambda s: s.id)
@pytest.mark.parametrize("name", ["torch", "torch-sdpa"])
def test_variant_gradients_come_back_in_their_shapes_and_agree_with_numpy_in_float64(name: str, spec: CaseSpec
                                                                                   ) -> None:
    """Every backward stage the case has (d_q_rot, d_k_rot with RoPE — partial rotary and GQA included —,
    d_sink_logits with sinks, d_bias in the bias input's shape, per batch or shared), and in float64 the
    numpy adapter's hand-written backward (tests/test_numpy_variants.py checks it against the loss's
    directional derivatives) within 1e-13 of max(1, the stage's magnitude): two float64 computations of a
    few roundings each (the worst seen is 1.7e-15); a variant's gradient taken wrongly is off by percents."""
    from mhaspec.adapters.numpy_mha import NumpyMHA
    from mhaspec.spec.backward import backward_stage_shapes
    from mhaspec.spec.stages import compared_entries

    adapter = load_adapter(name)
    if undeclared(spec, adapter.variants) is not None:  # softcap in torch-sdpa: never run (test above)
        return
    case = spec.case("float64")
    bias_shape = None if case.inputs.bias is None else case.inputs.bias.shape
    shapes = backward_stage_shapes(case.config, case.B, case.T, case.S, spec.inputs, bias_shape)
    got = adapter.backward(case)
    assert set(got) == set(shapes) - (SDPA_HIDDEN_GRADIENTS if name == "torch-sdpa" else set())
    want, visible = NumpyMHA().backward(case), case.visible
    for stage, value in got.items():
        assert value.shape == shapes[stage], stage
        entries = compared_entries(stage, visible)
        g, w = (x if entries is None else x[entries] for x in (np.asarray(value, np.float64), want[stage]))
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-13 * max(1.0, float(np.abs(w).max(initial=0.0))),
                                   err_msg=stage)


def test_sdpa_bias_gradient_is_summed_to_the_bias_input_s_shape() -> None:
    """With ALiBi (per head) and a bias shared by the heads, SDPA's float mask is (1, H, T, S): its
    gradient summed over H is d_bias (1, 1, T, S) — the torch module's, whose bias leaf is broadcast by autograd."""
    spec = next(s for s in VARIANT_SPECS if s.id == "alibi_causal_shared_bias")
    case = spec.case("float64")
    sdpa, layer = (load_adapter(n).backward(case) for n in ("torch-sdpa", "torch"))
    assert case.inputs.bias.shape == sdpa["d_bias"].shape == (1, 1, case.T, case.S)
    np.testing.assert_allclose(sdpa["d_bias"], layer["d_bias"], rtol=0, atol=1e-13)  # |d_bias| <= 2.1 here


def _rope_config(style: str) -> MHAConfig:
    return MHAConfig(d_model=4, num_heads=1, rope={"theta": 10000.0, "style": style})


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope_by_hand(style: str) -> None:
    # D = r = 4: pair 0 turns by position · 10000^0 = 1 rad, pair 1 by 10000^(-2/4) = 0.01 rad (position 1)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.float64)  # (B=1, L=1, 4)
    got = backend.rope(x, 1, torch.tensor([1]), _rope_config(style))[0, 0].tolist()
    c0, s0, c1, s1 = math.cos(1.0), math.sin(1.0), math.cos(0.01), math.sin(0.01)
    if style == "half":  # pairs (0, 2), (1, 3): HF's rotate_half
        want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1]
    else:  # pairs (0, 1), (2, 3): GPT-J
        want = [1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1, 4 * c1 + 3 * s1]
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-16)


def test_rope_partial_passes_the_rest_through_and_position_zero_is_identity() -> None:
    cfg = MHAConfig(d_model=12, num_heads=2, rope={"rotary_dim": 2})  # D = 6: features 2..5 pass
    x = torch.arange(1.0, 25.0, dtype=torch.float64).reshape(1, 2, 12)  # positions 0 and 3
    got = backend.rope(x, 2, torch.tensor([0, 3]), cfg)
    assert torch.equal(got[0, 0], x[0, 0])  # angle 0: cos 1, sin 0
    heads, turned = got[0, 1].reshape(2, 6), x[0, 1].reshape(2, 6)
    assert torch.equal(heads[:, 2:], turned[:, 2:])
    a, b = turned[:, 0], turned[:, 1]
    torch.testing.assert_close(heads[:, 0], a * math.cos(3) - b * math.sin(3), rtol=0, atol=1e-14)


def test_sdpa_sink_column_by_hand() -> None:
    # one head, q = 0: the three keys score 0 and the sink ln 3, so e^0·3 + 3 = 6 in the denominator;
    # the sink's value is 0: out = (1 + 2 + 3) / 6 = 1, and the weights sum to 1/2
    Q, K = torch.zeros(1, 1, 1, 2, dtype=torch.float64), torch.ones(1, 1, 3, 2, dtype=torch.float64)
    V = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).reshape(1, 1, 3, 1)
    K2, V2, mask = torch_sdpa.with_sink_column(K, V, None, torch.tensor([math.log(3.0)], dtype=torch.float64), 1)
    assert K2.shape == (1, 1, 4, 2) and V2.shape == (1, 1, 4, 1) and mask.shape == (1, 1, 1, 4)
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, 0.0, math.log(3.0)]
    out = torch.nn.functional.scaled_dot_product_attention(Q, K2, V2, attn_mask=mask)
    assert out.item() == pytest.approx(1.0, abs=1e-15)


def test_flex_sinks_through_the_lse_by_hand() -> None:
    # lse = ln 3, sink = 0 (e^0 = 1): out' = out · 3/4, lse' = ln 4; a row without keys stays 0 and -inf
    out = torch.tensor([[[[2.0], [0.0]]]], dtype=torch.float64)  # (1, 1, 2, 1)
    lse = torch.tensor([[[math.log(3.0), float("-inf")]]], dtype=torch.float64)
    got, got_lse = torch_flex.with_sinks(out, lse, torch.zeros(1, dtype=torch.float64))
    assert got[0, 0, :, 0].tolist() == pytest.approx([1.5, 0.0], abs=1e-15)
    assert got_lse[0, 0, 0].item() == pytest.approx(math.log(4.0), abs=1e-15)
    assert got_lse[0, 0, 1].item() == float("-inf")


def test_flex_lse_is_a_natural_log_and_a_row_without_keys_is_zero_and_minus_inf() -> None:
    # q = 0: every score is 0, so a row that sees all 5 keys has lse ln 5 (log2 would give 2.32)
    q, k = torch.zeros(1, 1, 3, 4, dtype=torch.float64), torch.ones(1, 1, 5, 4, dtype=torch.float64)
    v = torch.arange(5.0, dtype=torch.float64).reshape(1, 1, 5, 1).expand(1, 1, 5, 4)
    mask = torch_flex.create_block_mask(lambda b, h, i, j: i != 1, 1, 1, 3, 5, device="cpu")  # row 1 sees nothing
    out, aux = torch_flex.flex_attention(q, k, v, block_mask=mask, return_aux=torch_flex.AuxRequest(lse=True))
    assert aux.lse[0, 0, 0].item() == pytest.approx(math.log(5.0), abs=1e-15)
    assert aux.lse[0, 0, 1].item() == float("-inf")
    assert (out[0, 0, 1] == 0).all() and out[0, 0, 0, 0].item() == pytest.approx(2.0, abs=1e-15)


def test_flex_has_no_backward_on_the_cpu() -> None:
    # what docs/torch.md says; if this fails, torch added it: give torch-flex a backward
    q = torch.zeros(1, 1, 2, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        torch_flex.flex_attention(q, q, q)
    assert not hasattr(torch_flex.TorchFlexAdapter(), "backward")


def test_what_each_adapter_declares() -> None:
    assert torch_layer.TorchMHAAdapter.variants == torch_flex.TorchFlexAdapter.variants == {
        "window", "softcap", "alibi", "bias", "sinks", "rope"}
    assert torch_sdpa.TorchSDPAAdapter.variants == {"window", "alibi", "bias", "sinks", "rope"}
    for adapter in (torch_mha.TorchMultiheadAttentionAdapter, torch_mha.TorchMultiheadAttentionFastAdapter):
        assert not getattr(adapter, "variants", frozenset())  # nn.MultiheadAttention has none of them


def test_torch_lse_in_half_precision_is_rounded_once() -> None:
    # torch.logsumexp of a bfloat16 tensor rounds x − max, each exp, the sum and its log to bfloat16
    # (torch/_refs: logsumexp); the adapter takes it in float32 and rounds once, as the standard
    # contract's "sums in float32 or wider" asks: within half a bfloat16 ulp of the exact lse of its own scores
    spec = next(s for s in VARIANT_SPECS if s.id == "sinks_window_masked_rows")
    case = spec.case("bfloat16")
    got = load_adapter("torch").run(case)
    scores, lse = np.asarray(got["scores"], np.float64), np.asarray(got["lse"], np.float64)
    sinks = case.weights.sink_logits  # exact in bfloat16
    for b, h, i in np.ndindex(lse.shape):
        seen = scores[b, h, i][case.visible[b, h, i]]
        if seen.size == 0:
            assert lse[b, h, i] == -np.inf
            continue
        exact = np.logaddexp.reduce(np.append(seen, sinks[h]))
        half_ulp = 2.0 ** (np.floor(np.log2(abs(exact))) - 8) if exact != 0 else 2.0**-134
        assert abs(lse[b, h, i] - exact) <= half_ulp * (1 + 2**-10), (b, h, i, lse[b, h, i], exact)


# -- decode(case): a schedule's calls against a hand-written KV cache (docs/serving.md) ----------------------

DECODE_CATALOG = [spec.id for spec in mhaspec.spec.CATALOG if spec.schedule is not None]


@pytest.mark.parametrize("name", ["torch", "torch-sdpa"])
@pytest.mark.parametrize(("dtype", "rel"), [
    # float64: the same few roundings as run's, summed over the L_c cached keys instead of all S (masked ones
    # add exact zeros): the worst seen is 1.3e-13 of the scale; a cache or position bug moves entries by O(1)
    ("float64", 1e-12),
    # float32: the worst seen is 2.4e-7 of the scale (SDPA's kernel sums the shorter rows in another order)
    ("float32", 2e-6),
])
def test_decode_calls_are_the_full_pass_rows(name: str, dtype: str, rel: float) -> None:
    adapter = load_adapter(name)
    cases = [golden_case(case_id, dtype) for case_id in DECODE_CATALOG]
    cases += [spec.case(dtype) for spec in decode_specs(adapter.variants)]
    for case in cases:
        assert_decode_matches_run(adapter, case, rel)


def test_flex_decodes_the_paged_cases_through_paged_attention_and_refuses_the_others() -> None:
    report = check_here("torch-flex", pattern="decode_*")
    assert report.ok and len(report.results) == 4 * len(DECODE_CATALOG), str(report)
    for result in report.results:
        if mhaspec.spec.CATALOG[result.case].page_size is None:
            assert result.verdict == "unsupported" and "decodes a paged case only" in result.message, result
            continue
        assert [call.verdict for call in result.calls] == ["pass"] * len(result.calls) and result.calls, result.case


@pytest.mark.parametrize("name", ["torch", "torch-sdpa"])
def test_decode_cases_conform_call_by_call(name: str) -> None:
    report = check_here(name, pattern="decode_*")
    assert report.ok and len(report.results) == 4 * len(DECODE_CATALOG), str(report)
    for result in report.results:
        assert [call.verdict for call in result.calls] == ["pass"] * len(result.calls) and result.calls, result.case


class TopLeftWithinTheCall(torch_sdpa.TorchSDPAAdapter):
    """The pitfall: SDPA's ``is_causal=True`` in every call of a causal case (as a full pass with T = S may),
    which aligns the diagonal top-left within the call: a decode step's one query sees key 0 only."""

    def _masks(self, case):
        return {"attn_mask": None, "is_causal": True}


def test_is_causal_within_a_call_is_aligned_top_left_and_caught() -> None:
    # what SDPA's is_causal means: query row i of a call sees keys j <= i counted from the call's first key, so a
    # decode step's one query sees key 0 only (its output is V's row 0)
    Q, K, V = (torch.randn(1, 1, n, 4, dtype=torch.float64) for n in (1, 5, 5))
    top_left = torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True)
    torch.testing.assert_close(top_left, V[:, :, :1], rtol=0, atol=1e-15)
    # judged: without a past, the prefill (T_c = S_c) is right and the first decode step fails; with a past,
    # the prefill already fails; in every dtype, at head_outputs (the first stage SDPA exposes after the mask)
    report = mhaspec.check(TopLeftWithinTheCall(), isolate=False, cases=["decode_prefill_steps", "decode_with_past"])
    assert len(report.results) == 8 and not report.ok
    for result in report.results:
        first = "call 2 of 7 (decode, cache 6)" if result.case == "decode_prefill_steps" else "call 1 of 5 (prefill, cache 6)"
        assert (result.verdict, result.first_failing_stage) == ("fail", "head_outputs"), (result.case, result.dtype)
        assert result.message.startswith(first + ": head_outputs fail"), result.message
        assert all(call.verdict == "fail" for call in result.calls[1:]), result.calls
