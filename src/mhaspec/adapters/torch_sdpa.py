"""``torch.nn.functional.scaled_dot_product_attention`` between ``nn.Linear``
projections (built-in adapter ``torch-sdpa``).

    query ─q_proj─► split heads ─┐
    key   ─k_proj─► split heads ─┼─► F.scaled_dot_product_attention ─► head_outputs (B, H, T, E)
    value ─v_proj─► split heads ─┘     (attn_mask: bool, True = take part;        │ concat heads
                                        is_causal; scale; enable_gqa)            ▼
                                                                  concat ─out_proj─► output

SDPA is fused: ``scores`` and ``attn_weights`` are not exposed.  Its
``is_causal`` is top-left aligned, and it refuses ``is_causal`` together with
an ``attn_mask``: a bottom-right (T != S) or masked causal case gets the
combined boolean mask instead.  Weights: the ``state_dict`` is the same as
:class:`mhaspec.adapters.torch_layer.MultiHeadAttention`'s (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``; ``weight`` is ``(out, in)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..spec import Case, MHAConfig, Weights
from .backends import torch as backend


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> :class:`SDPAMultiHeadAttention` ``state_dict``:
    ``q_proj.weight = w_q.T``, ``k_proj.weight = w_k.T``, ``v_proj.weight = w_v.T``,
    ``out_proj.weight = w_o.T`` (each ``(out, in)``), ``*.bias = b_*``."""
    return backend.weights_in(weights)


def state_dict_to_canonical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """:class:`SDPAMultiHeadAttention` ``state_dict`` -> canonical float64 weights."""
    return backend.weights_out(state_dict)


class SDPAMultiHeadAttention(nn.Module):
    """Four ``nn.Linear`` around ``F.scaled_dot_product_attention``.

    ``config`` fixes the sizes and the scale; masking is SDPA's own
    (``attn_mask``, ``is_causal``), passed through by ``forward``.
    """

    def __init__(self, config: MHAConfig, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cfg = self.config = config
        factory = {"device": device, "dtype": dtype}
        kdim, vdim = int(cfg.kdim), int(cfg.vdim)  # type: ignore[arg-type]
        self.q_proj = nn.Linear(cfg.d_model, cfg.H * cfg.D_k, bias=cfg.bias, **factory)  # W^Q
        self.k_proj = nn.Linear(kdim, cfg.H_kv * cfg.D_k, bias=cfg.bias, **factory)  # W^K
        self.v_proj = nn.Linear(vdim, cfg.H_kv * cfg.D_v, bias=cfg.bias, **factory)  # W^V
        self.out_proj = nn.Linear(cfg.H * cfg.D_v, cfg.d_out, bias=cfg.bias, **factory)  # W^O

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> dict[str, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim); attn_mask and
        is_causal as ``F.scaled_dot_product_attention`` takes them.  Returns the stages
        it sees: q_proj, k_proj, v_proj, head_outputs, concat, output."""
        cfg = self.config
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        q = self.q_proj(query)  # (B, T, H·D)
        k = self.k_proj(key)  # (B, S, G·D)
        v = self.v_proj(value)  # (B, S, G·E)
        head_outputs = F.scaled_dot_product_attention(
            query=q.view(B, T, cfg.H, cfg.D_k).transpose(1, 2),  # (B, H, T, D)
            key=k.view(B, S, cfg.H_kv, cfg.D_k).transpose(1, 2),  # (B, G, S, D)
            value=v.view(B, S, cfg.H_kv, cfg.D_v).transpose(1, 2),  # (B, G, S, E)
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=cfg.scale,
            **({"enable_gqa": True} if cfg.H_kv != cfg.H else {}),  # keyword exists from torch 2.5
        )  # (B, H, T, E)
        concat = head_outputs.transpose(1, 2).reshape(B, T, cfg.H * cfg.D_v)  # (B, T, H·E)
        output = self.out_proj(concat)  # (B, T, d_out)
        return {"q_proj": q, "k_proj": k, "v_proj": v, "head_outputs": head_outputs, "concat": concat, "output": output}


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


class TorchSDPAAdapter:
    """The ``torch-sdpa`` adapter."""

    name = "torch-sdpa"
    framework = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def supports(self, case: Case) -> bool | str:
        if case.config.H_kv != case.config.H and _torch_version() < (2, 5):
            return f"grouped-query attention needs SDPA's enable_gqa (torch >= 2.5; this is {torch.__version__})"
        return True

    def _module(self, case: Case) -> SDPAMultiHeadAttention:
        return backend.loaded_module(SDPAMultiHeadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     config=case.config)

    def _call(self, module: SDPAMultiHeadAttention, case: Case) -> backend.StagesCall:
        """``module``'s forward with the case's masking as SDPA takes it."""
        if backend.top_left_causal_only(case):  # SDPA's is_causal is top-left and excludes attn_mask
            masks: dict[str, Any] = {"attn_mask": None, "is_causal": True}
        else:
            masks = {"attn_mask": backend.keep_mask(case, self.device), "is_causal": False}  # bool, True = take part

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, **masks)

        return call

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return backend.inference(case, self.device, self._call(self._module(case), case))

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``torch.autograd`` through SDPA's own backward: the projections'
        and the head outputs' gradients through ``retain_grad`` (SDPA exposes no d_scores, d_attn_weights)."""
        module = self._module(case)
        return backend.autograd_backward(case, self.device, self._call(module, case), module, state_dict_to_canonical)
