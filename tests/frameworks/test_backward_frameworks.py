"""Backward facts of the framework adapters (autograd / jax.vjp): torch-mha's declared NaN
gradients, the float64 reference against torch autograd, a user's autograd Function.  Each
built-in adapter's backward on the whole catalog (passes or declares, exposes the stages
its layer allows): tests/frameworks/test_catalog_runs.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import GOLDEN, check_here

import mhaspec
from mhaspec.conformance import FAIL, KNOWN_DEVIATION, PASS
from mhaspec.spec.variants import variants_used

ROOT = Path(__file__).resolve().parents[2]
FEW = ["self_basic", "cross_attention", "gqa", "custom_mask", "causal_bottom_right", "large_logits"]
TORCH = pytest.mark.torch


@TORCH
def test_torch_mha_nan_gradients_are_declared_only_where_rows_see_no_key() -> None:
    require("torch")
    report = check_here("torch-mha", dtypes=["float32"], cases=["custom_mask", "cross_attention"], backward=True)
    masked = report.result("custom_mask", "float32")
    assert masked.verdict == KNOWN_DEVIATION
    assert masked.stage("d_key").verdict == KNOWN_DEVIATION and masked.stage("d_b_o").verdict == PASS
    assert report.result("cross_attention", "float32").verdict == PASS


@TORCH
def test_reference_backward_agrees_with_torch_autograd_in_float64() -> None:
    torch = require("torch")
    for g in GOLDEN:
        if variants_used(g.spec):
            continue  # a variant case's fixture is forward only (docs/spec.md §2a): no backward to agree with
        cfg, self_attention = g.spec.config, g.spec.inputs == "self"

        def leaf(a):
            return torch.tensor(np.array(a), dtype=torch.float64, requires_grad=True)

        x = {k: leaf(v) for k, v in g.inputs.items() if k != "mask"}
        if self_attention:
            x["key"] = x["value"] = x["query"]
        elif g.spec.inputs == "shared_kv":
            x["value"] = x["key"]  # one memory tensor: its gradient is d_key
        w = {k: leaf(v) for k, v in g.weights.items()}
        vis = torch.tensor(g.visible)
        B, T, _ = x["query"].shape
        S, H, G, D, E = x["key"].shape[1], cfg.H, cfg.H_kv, cfg.D_k, cfg.D_v

        def lin(a, n):
            return a @ w[f"w_{n}"] + (w[f"b_{n}"] if f"b_{n}" in w else 0)

        q, k, v = lin(x["query"], "q"), lin(x["key"], "k"), lin(x["value"], "v")
        Q = q.view(B, T, H, D).transpose(1, 2)
        K = k.view(B, S, G, D).transpose(1, 2).repeat_interleave(H // G, 1)
        V = v.view(B, S, G, E).transpose(1, 2).repeat_interleave(H // G, 1)
        s = Q @ K.transpose(-1, -2) * cfg.scale
        p = torch.softmax(s.masked_fill(~vis, -torch.inf), -1).masked_fill(~vis, 0)
        o = p @ V
        c = o.transpose(1, 2).reshape(B, T, H * E)
        for t in (q, k, v, s, p, o, c):
            t.retain_grad()
        lin(c, "o").backward(torch.tensor(g.d_output))
        got = {"d_concat": c.grad, "d_head_outputs": o.grad, "d_attn_weights": p.grad * vis, "d_scores": s.grad,
               "d_q_proj": q.grad, "d_k_proj": k.grad, "d_v_proj": v.grad, "d_query": x["query"].grad}
        if not self_attention:
            got["d_key"] = x["key"].grad
        if g.spec.inputs == "distinct":
            got["d_value"] = x["value"].grad
        got.update({f"d_{n}": w[n].grad for n in w})
        assert set(got) == {s for s in g.stages if s.startswith("d_")}
        for name, value in got.items():
            ref = g.stages[name]
            scale = np.abs(g.stages["d_k_proj"]).max() if name == "d_b_k" else np.abs(ref).max()  # d_b_k is ~0
            assert np.abs(value.detach().numpy() - ref).max() <= 1e-13 * max(scale, 1e-300), (g.id, name)


@TORCH
def test_user_autograd_function_example_conforms_and_its_buggy_twin_fails() -> None:
    require("torch")
    path = ROOT / "examples" / "torch_autograd_adapter.py"
    good = mhaspec.check(f"{path}:MyAttentionFunctionMHA", dtypes=["float32", "bfloat16"], cases=FEW, backward=True)
    assert good.ok, good.table()
    bad = mhaspec.check(f"{path}:ForgotJacobianTerm", dtypes=["float32", "bfloat16"], cases=FEW, backward=True)
    # The layer fuses d_scores away: the bug shows first in d_q_proj, through the golden check alone.
    assert all(r.verdict == FAIL and r.first_failing_stage == "d_q_proj" for r in bad.results), bad.table()
