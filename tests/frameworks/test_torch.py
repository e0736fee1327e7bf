"""The PyTorch adapters: converters, mask polarity, supports() reasons, conformance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import GOLDEN, arange_weights, assert_same_weights, check_here, golden_case

torch = require("torch")

import mhaspec  # noqa: E402
from mhaspec.adapters import torch_layer, torch_mha, torch_sdpa  # noqa: E402
from mhaspec.adapters.backends.torch import keep_mask  # noqa: E402
from mhaspec.reference.onthefly import OnTheFlyGolden  # noqa: E402
from mhaspec.spec import MHAConfig  # noqa: E402

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
