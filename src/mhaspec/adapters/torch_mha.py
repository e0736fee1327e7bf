"""``torch.nn.MultiheadAttention`` loaded with the case's weights (built-in
adapters ``torch-mha`` and ``torch-mha-fast``).

Two ways of calling the same layer, reported separately because PyTorch runs
them through different code:

- ``torch-mha``: ``need_weights=True, average_attn_weights=False`` -- the
  per-head ``attn_weights (B, H, T, S)`` come back with the ``output``.  For a
  self-attention call in eval mode with an even H and biases this is the
  native fast path (``torch._native_multi_head_attention``); otherwise
  ``F.multi_head_attention_forward``'s explicit softmax.
- ``torch-mha-fast``: ``need_weights=False``, as production code calls it --
  the native fast path, or ``F.scaled_dot_product_attention``; only
  ``output`` comes back.

Weight layout (``state_dict`` keys; every weight is ``(out, in)``,
``y = x @ weight.T + bias``):

- kdim == vdim == d_model: ``in_proj_weight (3·d_model, d_model)``, rows in
  the order q, k, v: ``[w_q.T; w_k.T; w_v.T]``;
- otherwise: ``q_proj_weight (d_model, d_model) = w_q.T``,
  ``k_proj_weight (d_model, kdim) = w_k.T``, ``v_proj_weight (d_model, vdim) = w_v.T``;
- ``in_proj_bias (3·d_model,) = [b_q, b_k, b_v]`` (both layouts);
- ``out_proj.weight (d_model, d_model) = w_o.T``, ``out_proj.bias = b_o``.

Masks: torch's polarity is the opposite of the spec's (True = blocked).  A
key-padding mask ``(B, 1, 1, S)`` becomes ``key_padding_mask (B, S)``; the
causal mask is ``attn_mask (T, S)`` (with the ``is_causal`` hint when it is
top-left); any other mask, ANDed with the causal one, is ``attn_mask (B·H, T, S)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..spec import Case, Weights
from .backends import declared
from .backends import torch as backend
from .backends.numpy import weights_in as canonical
from .backends.torch import as_float64

_Q, _K, _V = "w_q", "w_k", "w_v"


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> ``nn.MultiheadAttention`` ``state_dict`` (float64 CPU tensors).

    Packed ``in_proj_weight`` (rows q, k, v) when kdim == vdim == d_model, else
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``; see the module docstring.
    """
    w = canonical(weights)
    d_model = w[_Q].shape[0]
    out: dict[str, torch.Tensor] = {}
    if w[_K].shape[0] == w[_V].shape[0] == d_model:
        out["in_proj_weight"] = torch.from_numpy(np.concatenate([w[_Q].T, w[_K].T, w[_V].T], axis=0))
    else:
        for name in (_Q, _K, _V):
            out[f"{name[-1]}_proj_weight"] = torch.from_numpy(np.array(w[name].T, order="C"))  # a copy: the case is read-only
    if "b_q" in w:
        out["in_proj_bias"] = torch.from_numpy(np.concatenate([w["b_q"], w["b_k"], w["b_v"]]))
    out["out_proj.weight"] = torch.from_numpy(np.array(w["w_o"].T, order="C"))  # a copy: the case is read-only
    if "b_o" in w:
        out["out_proj.bias"] = torch.from_numpy(w["b_o"].copy())
    return out


def state_dict_to_canonical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``nn.MultiheadAttention`` ``state_dict`` -> canonical float64 weights (``w_q`` … ``b_o``)."""
    out: dict[str, np.ndarray] = {}
    if state_dict.get("in_proj_weight") is not None:
        packed = as_float64(state_dict["in_proj_weight"])  # (3·d_model, d_model), rows q, k, v
        for name, block in zip((_Q, _K, _V), np.split(packed, 3, axis=0)):
            out[name] = block.T.copy()
    else:
        for name in (_Q, _K, _V):
            out[name] = as_float64(state_dict[f"{name[-1]}_proj_weight"]).T.copy()
    out["w_o"] = as_float64(state_dict["out_proj.weight"]).T.copy()
    if state_dict.get("in_proj_bias") is not None:
        for name, block in zip(("b_q", "b_k", "b_v"), np.split(as_float64(state_dict["in_proj_bias"]), 3)):
            out[name] = block.copy()
    if state_dict.get("out_proj.bias") is not None:
        out["b_o"] = as_float64(state_dict["out_proj.bias"])
    return out


def torch_masks(case: Case, device: torch.device | str) -> dict[str, Any]:
    """The case's masks as ``nn.MultiheadAttention`` keyword arguments (True = blocked)."""
    cfg, B, T, S = case.config, case.batch, case.tgt_len, case.src_len
    mask = case.inputs.mask
    kwargs: dict[str, Any] = {}
    key_padding = mask is not None and mask.ndim == 4 and mask.shape[1:3] == (1, 1)
    if key_padding:  # (B|1, 1, 1, S): the keys each batch entry may see
        visible = backend.array_in(np.broadcast_to(mask, (B, 1, 1, S)).reshape(B, S), torch.bool, device)
        kwargs["key_padding_mask"] = ~visible
    visible = None
    if mask is not None and not key_padding:
        visible = backend.array_in(np.broadcast_to(mask, (B, cfg.H, T, S)), torch.bool, device)
    if cfg.causal:
        causal = backend.causal_visible(cfg, T, S, device)
        visible = causal if visible is None else visible & causal
    if visible is not None:
        kwargs["attn_mask"] = ~(visible.reshape(B * cfg.H, T, S) if visible.dim() == 4 else visible)
        kwargs["is_causal"] = backend.top_left_causal_only(case)  # a hint torch trusts: only for the plain top-left mask
    return kwargs


class TorchMultiheadAttentionAdapter:
    """``torch-mha``: ``nn.MultiheadAttention`` with ``need_weights=True``, per-head weights."""

    name = "torch-mha"
    framework = "torch"
    need_weights = True

    #: Rows that see no key come out NaN: the need_weights=True path adds -inf and calls plain
    #: softmax (0/0).  Open upstream since 2020.  Scoped to those rows: anything else still fails.
    known_deviations = declared("torch", "torch-mha")

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.H_kv != cfg.H:
            return f"nn.MultiheadAttention has no grouped-query attention (H={cfg.H}, H_kv={cfg.H_kv})"
        if cfg.D_k * cfg.H != cfg.d_model:
            return f"nn.MultiheadAttention fixes head_dim = d_model / H = {cfg.d_model / cfg.H:g}, case has {cfg.D_k}"
        if cfg.D_v != cfg.D_k:
            return f"nn.MultiheadAttention has one head size for keys and values (D_k={cfg.D_k}, D_v={cfg.D_v})"
        if cfg.d_out != cfg.d_model:
            return f"nn.MultiheadAttention's output has d_model={cfg.d_model} features, case has d_out={cfg.d_out}"
        if not math.isclose(cfg.scale, 1.0 / math.sqrt(cfg.D_k), rel_tol=1e-12):
            return f"nn.MultiheadAttention has no scale argument: always 1/sqrt(head_dim), case has {cfg.scale:g}"
        return True

    def _module(self, case: Case) -> nn.MultiheadAttention:
        cfg = case.config
        return backend.loaded_module(nn.MultiheadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     embed_dim=cfg.d_model, num_heads=cfg.H, bias=cfg.bias, kdim=cfg.kdim,
                                     vdim=cfg.vdim, batch_first=True)

    def _call(self, module: nn.MultiheadAttention, case: Case) -> backend.StagesCall:
        """The layer called with the case's masks: ``attn_weights`` (need_weights) and ``output``."""
        masks = torch_masks(case, self.device)

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            output, attn_weights = module(query=query, key=key, value=value, need_weights=self.need_weights,
                                          average_attn_weights=False, **masks)
            return {"output": output} if attn_weights is None else {"attn_weights": attn_weights, "output": output}

        return call

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return backend.inference(case, self.device, self._call(self._module(case), case))

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The input and weight gradients by ``torch.autograd``: the layer exposes no intermediate
        stage to the backward (the attention weights it returns are a view made after their last
        use, so no gradient reaches them).  With gradients enabled the native fast path is never taken."""
        module = self._module(case)
        return backend.autograd_backward(case, self.device, self._call(module, case), module, state_dict_to_canonical)


class TorchMultiheadAttentionFastAdapter(TorchMultiheadAttentionAdapter):
    """``torch-mha-fast``: the same layer with ``need_weights=False`` (native fast path or SDPA)."""

    name = "torch-mha-fast"
    need_weights = False
    #: The native fast path (self-attention, even H, biases, eval, no grad) masks with -inf and
    #: softmaxes without zeroing: NaN for such rows.  The SDPA route gives zeros.
    known_deviations = declared("torch", "torch-mha-fast")
