"""Backward conformance of a user's own ``torch.autograd.Function`` (docs/backward.md).

    mhaspec run examples/torch_autograd_adapter.py:MyAttentionFunctionMHA --backward
    mhaspec run examples/torch_autograd_adapter.py:ForgotJacobianTerm --backward   # fails at d_q_proj

``MyAttention`` is an attention core with a hand-written backward, as a custom
kernel would have; the adapter wraps it between ``nn.Linear`` projections,
returns the forward stages it sees from ``run`` and, from ``backward``, the
gradients autograd gives (intermediate ones through ``retain_grad``).
"""

from __future__ import annotations

import torch
from torch import nn

from mhaspec.adapters.torch_layer import canonical_to_state_dict, state_dict_to_canonical


class MyAttention(torch.autograd.Function):
    """softmax(scale·Q Kᵀ, masked) V for (B, H, T, D) tensors; visible (B|1, H|1, T, S) bool, True = may attend."""

    @staticmethod
    def forward(ctx, Q, K, V, visible, scale):
        s = (Q @ K.transpose(-2, -1)) * scale
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)  # no key: zeros
        ctx.save_for_backward(Q, K, V, p)
        ctx.scale = scale
        return p @ V

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, p = ctx.saved_tensors
        dP = dO @ V.transpose(-2, -1)
        dS = p * (dP - (p * dP).sum(-1, keepdim=True))  # the softmax Jacobian
        return dS @ K * ctx.scale, dS.transpose(-2, -1) @ Q * ctx.scale, p.transpose(-2, -1) @ dO, None, None


class ForgotJacobian(MyAttention):
    @staticmethod
    def backward(ctx, dO):
        Q, K, V, p = ctx.saved_tensors
        dS = p * (dO @ V.transpose(-2, -1))  # bug: the −Σ p·dP term is missing
        return dS @ K * ctx.scale, dS.transpose(-2, -1) @ Q * ctx.scale, p.transpose(-2, -1) @ dO, None, None


class Layer(nn.Module):
    """Four nn.Linear around the attention function (GQA by repeating key/value heads)."""

    def __init__(self, cfg, attention, dtype):
        super().__init__()
        self.cfg, self.attention = cfg, attention
        self.q_proj = nn.Linear(cfg.d_model, cfg.H * cfg.D_k, bias=cfg.bias, dtype=dtype)
        self.k_proj = nn.Linear(cfg.kdim, cfg.H_kv * cfg.D_k, bias=cfg.bias, dtype=dtype)
        self.v_proj = nn.Linear(cfg.vdim, cfg.H_kv * cfg.D_v, bias=cfg.bias, dtype=dtype)
        self.out_proj = nn.Linear(cfg.H * cfg.D_v, cfg.d_out, bias=cfg.bias, dtype=dtype)

    def forward(self, query, key, value, visible):
        cfg, (B, T), S = self.cfg, query.shape[:2], key.shape[1]
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        Q = q.view(B, T, cfg.H, cfg.D_k).transpose(1, 2)
        K = k.view(B, S, cfg.H_kv, cfg.D_k).transpose(1, 2).repeat_interleave(cfg.group_size, 1)
        V = v.view(B, S, cfg.H_kv, cfg.D_v).transpose(1, 2).repeat_interleave(cfg.group_size, 1)
        o = self.attention.apply(Q, K, V, visible, cfg.scale)  # (B, H, T, E)
        c = o.transpose(1, 2).reshape(B, T, -1)
        return {"q_proj": q, "k_proj": k, "v_proj": v, "head_outputs": o, "concat": c, "output": self.out_proj(c)}


class MyAttentionFunctionMHA:
    name = "my-attention-function"
    attention = MyAttention

    def _layer_and_inputs(self, case, grad):
        dtype, cfg = getattr(torch, case.dtype), case.config
        layer = Layer(cfg, self.attention, dtype)
        layer.load_state_dict(canonical_to_state_dict(case.weights))  # canonical W is (in, out); Linear wants W.T
        # one tensor where the case has one (self-attention: its gradient is the sum of the three, d_query;
        # one memory tensor for key and value: d_key)
        query, key, value = case.inputs_as(lambda a: torch.tensor(a, dtype=dtype, requires_grad=grad))
        x = {"query": query, "key": key, "value": value}
        T, S = case.tgt_len, case.src_len
        visible = torch.ones(T, S, dtype=torch.bool)
        if cfg.causal:
            shift = 0 if cfg.causal_alignment == "top_left" else S - T
            visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + shift
        if case.inputs.mask is not None:
            visible = visible & torch.from_numpy(case.inputs.mask.copy())
        return layer, x, visible

    def run(self, case):
        layer, x, visible = self._layer_and_inputs(case, grad=False)
        with torch.no_grad():
            stages = layer(**x, visible=visible)
        return {n: t.double().numpy() for n, t in stages.items()}  # float64 holds every dtype's values exactly

    def backward(self, case):
        layer, x, visible = self._layer_and_inputs(case, grad=True)
        stages = layer(**x, visible=visible)
        for t in stages.values():
            t.retain_grad()
        stages["output"].backward(torch.tensor(case.d_output, dtype=stages["output"].dtype))
        grads = {f"d_{n}": t.grad for n, t in stages.items() if n != "output"}
        distinct = {id(t): n for n, t in reversed(x.items())}.values()  # each tensor once, by its first name
        grads.update({f"d_{n}": x[n].grad for n in distinct})
        grads = {n: g.double().numpy() for n, g in grads.items()}
        weight_grads = state_dict_to_canonical({n: p.grad for n, p in layer.named_parameters()})
        return grads | {f"d_{n}": g for n, g in weight_grads.items()}


class ForgotJacobianTerm(MyAttentionFunctionMHA):
    name = "my-attention-function-buggy"
    attention = ForgotJacobian
