"""Check your own PyTorch attention module:  mhaspec run examples/torch_adapter.py:MyTorchMHA"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class MyAttention(nn.Module):
    """Stands for your module: fused QKV projection, SDPA, output projection (self-attention only)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)  # weight (3·dim, dim): rows q, k, v
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):  # x (B, T, dim); mask bool, True = may attend
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MyTorchMHA:
    name = "my-torch-mha"

    def supports(self, case):
        c = case.config
        if not case.self_attention or c.causal or c.H_kv != c.H or c.D_v != c.D_k or c.d_out != c.d_model:
            return "MyAttention is plain self-attention: no cross-attention, causal, GQA, D_v or d_out"
        if c.D_k * c.H != c.d_model or abs(c.scale * c.D_k**0.5 - 1) > 1e-12:
            return "MyAttention fixes head_dim = dim / heads and scale = 1/sqrt(head_dim)"
        return True

    def run(self, case):
        c, w, dtype = case.config, case.weights, getattr(torch, case.dtype)
        b = w.as_dict() if c.bias else dict.fromkeys(["b_q", "b_k", "b_v", "b_o"], np.zeros(c.d_model))
        state = {  # canonical W is (in, out), y = x @ W + b; nn.Linear's weight is W.T
            "qkv.weight": np.concatenate([w.w_q, w.w_k, w.w_v], axis=1).T,
            "qkv.bias": np.concatenate([b["b_q"], b["b_k"], b["b_v"]]),
            "proj.weight": w.w_o.T,
            "proj.bias": b["b_o"],
        }
        module = MyAttention(c.d_model, c.H).to(dtype)  # cast first: float32 params would round float64 weights
        module.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
        x = torch.from_numpy(case.inputs.query.copy()).to(dtype)
        mask = None if case.inputs.mask is None else torch.from_numpy(case.inputs.mask.copy())
        with torch.inference_mode():
            y = module(x, mask=mask)
        return {"output": y.double().numpy()}  # float64 holds the values of every dtype exactly
