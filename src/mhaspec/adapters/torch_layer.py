"""Multi-head attention as a plain ``torch.nn.Module``, returning every stage
(built-in adapter ``torch``).

    query (B, T, d_model)   key (B, S, kdim)   value (B, S, vdim)
        │ q_proj                │ k_proj           │ v_proj          four nn.Linear:
        ▼                       ▼                  ▼                 W^Q, W^K, W^V, W^O
    q (B, T, H·D)           k (B, S, G·D)      v (B, S, G·E)
        │ split heads           │ split, repeat    │ split, repeat   head h reads kv head h // (H/G)
        ▼                       ▼                  ▼
    Q (B, H, T, D)  ──►  scores = scale · Q Kᵀ (B, H, T, S)
                            │ mask (True = may attend) AND causal; softmax over S
                            ▼
                     attn_weights (B, H, T, S)  ──►  head_outputs = attn_weights · V (B, H, T, E)
                                                         │ concat heads
                                                         ▼
                                                    concat (B, T, H·E) ──out_proj──► output (B, T, d_out)

:class:`MultiHeadAttention` is a reusable module (kdim/vdim, D_v != D_k,
d_out, GQA/MQA, masks, causal in both alignments).  Its ``state_dict`` has
``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``nn.Linear``: ``weight`` is
``(out, in)``, ``y = x @ weight.T + bias``); :func:`canonical_to_state_dict`
and :func:`state_dict_to_canonical` convert from and to the canonical weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..spec import Case, MHAConfig, Weights
from .backends import torch as backend


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> :class:`MultiHeadAttention` ``state_dict``.

    ``q_proj.weight = w_q.T (H·D_k, d_model)``, ``k_proj.weight = w_k.T (H_kv·D_k, kdim)``,
    ``v_proj.weight = w_v.T (H_kv·D_v, vdim)``, ``out_proj.weight = w_o.T (d_out, H·D_v)``,
    ``*.bias = b_*``.  float64 CPU tensors; ``load_state_dict`` casts them.
    """
    return backend.weights_in(weights)


def state_dict_to_canonical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """:class:`MultiHeadAttention` ``state_dict`` -> canonical float64 weights (``w_q`` … ``b_o``)."""
    return backend.weights_out(state_dict)


class MultiHeadAttention(nn.Module):
    """Multi-head attention with four ``nn.Linear`` layers, as the spec defines it.

    Constructor arguments are the fields of :class:`mhaspec.spec.MHAConfig`
    (defaults resolved there), plus ``device`` and ``dtype`` for the parameters.
    ``forward`` returns the output ``(B, T, d_out)``, or with
    ``return_stages=True`` a dict of every stage (``q_proj`` … ``output``).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
        scale: float | None = None,
        causal: bool = False,
        causal_alignment: str = "top_left",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        cfg = MHAConfig(
            d_model=d_model, num_heads=num_heads, kdim=kdim, vdim=vdim, num_kv_heads=num_kv_heads,
            head_dim=head_dim, value_head_dim=value_head_dim, out_dim=out_dim, bias=bias, scale=scale,
            causal=causal, causal_alignment=causal_alignment,  # type: ignore[arg-type]
        )
        self.config = cfg
        factory = {"device": device, "dtype": dtype}
        kdim, vdim = int(cfg.kdim), int(cfg.vdim)  # type: ignore[arg-type]
        self.q_proj = nn.Linear(cfg.d_model, cfg.H * cfg.D_k, bias=bias, **factory)  # W^Q
        self.k_proj = nn.Linear(kdim, cfg.H_kv * cfg.D_k, bias=bias, **factory)  # W^K
        self.v_proj = nn.Linear(vdim, cfg.H_kv * cfg.D_v, bias=bias, **factory)  # W^V
        self.out_proj = nn.Linear(cfg.H * cfg.D_v, cfg.d_out, bias=bias, **factory)  # W^O

    @classmethod
    def from_config(cls, config: MHAConfig, **factory: Any) -> MultiHeadAttention:
        """A module for ``config`` (``factory``: ``device``, ``dtype``)."""
        return cls(**config.model_dump(), **factory)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"H={c.H}, H_kv={c.H_kv}, D_k={c.D_k}, D_v={c.D_v}, scale={c.scale:g}, "
            f"causal={c.causal}" + (f" ({c.causal_alignment})" if c.causal else "")
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        *,
        return_stages: bool = False,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim) — key and value
        default to query; mask: bool broadcastable to (B, H, T, S), True = may attend
        (the polarity of ``F.scaled_dot_product_attention``)."""
        cfg = self.config
        key = query if key is None else key
        value = key if value is None else value
        B, T, S = query.shape[0], query.shape[1], key.shape[1]
        H, G, D, E = cfg.H, cfg.H_kv, cfg.D_k, cfg.D_v

        # 1. Project, then split heads: head h owns features [h·D, (h+1)·D).
        q = self.q_proj(query)  # (B, T, H·D)
        k = self.k_proj(key)  # (B, S, G·D)
        v = self.v_proj(value)  # (B, S, G·E)
        Q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        K = k.view(B, S, G, D).transpose(1, 2).repeat_interleave(cfg.group_size, dim=1)  # (B, H, S, D)
        V = v.view(B, S, G, E).transpose(1, 2).repeat_interleave(cfg.group_size, dim=1)  # (B, H, S, E)

        # 2. Attend: scaled dot products, masked softmax over S, weighted sum of values.
        scores = (Q @ K.transpose(-2, -1)) * cfg.scale  # (B, H, T, S)
        allowed = self._visible(mask, T, S, query.device)
        if allowed is None:
            attn_weights = torch.softmax(scores, dim=-1)
        else:
            attn_weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            # Masked entries are 0 -- also in a row that sees no key, where softmax gave NaN.
            attn_weights = attn_weights.masked_fill(~allowed, 0.0)
        head_outputs = attn_weights @ V  # (B, H, T, E)

        # 3. Concat heads in head order, then the output projection.
        concat = head_outputs.transpose(1, 2).reshape(B, T, H * E)  # (B, T, H·E)
        output = self.out_proj(concat)  # (B, T, d_out)
        if not return_stages:
            return output
        return {
            "q_proj": q, "k_proj": k, "v_proj": v, "scores": scores, "attn_weights": attn_weights,
            "head_outputs": head_outputs, "concat": concat, "output": output,
        }

    def _visible(self, mask: torch.Tensor | None, T: int, S: int, device: torch.device) -> torch.Tensor | None:
        """The explicit mask AND the causal mask (True = may attend), or None."""
        cfg = self.config
        allowed = None if mask is None else mask.to(device=device, dtype=torch.bool)
        if cfg.causal:
            causal = backend.causal_visible(cfg, T, S, device)
            allowed = causal if allowed is None else allowed & causal
        return allowed


class TorchMHAAdapter:
    """The ``torch`` adapter: :class:`MultiHeadAttention` loaded with the case's weights."""

    name = "torch"
    framework = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def _module(self, case: Case) -> MultiHeadAttention:
        return backend.loaded_module(MultiHeadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     **case.config.model_dump())

    def _call(self, module: MultiHeadAttention, case: Case) -> backend.StagesCall:
        """``module``'s forward with the case's mask, every stage returned."""
        mask = None if case.inputs.mask is None else backend.array_in(case.inputs.mask, torch.bool, self.device)

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, mask=mask, return_stages=True)

        return call

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return backend.inference(case, self.device, self._call(self._module(case), case))

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``torch.autograd``: intermediate stages through ``retain_grad``."""
        module = self._module(case)
        return backend.autograd_backward(case, self.device, self._call(module, case), module, state_dict_to_canonical)
