"""What the three PyTorch adapters share: dtypes, devices, tensors in and out,
the mask in the spec's polarity, and the ``nn.Linear`` weight layout.

Layout of ``nn.Linear`` (and of every weight in ``nn.MultiheadAttention``):
``weight`` is ``(out_features, in_features)`` and the layer computes
``y = x @ weight.T + bias``.  The canonical weights are ``(in, out)``
(``y = x @ W + b``), so ``weight = W.T`` and ``bias = b``; the column blocks
of ``W`` that belong to head h become row blocks of ``weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..spec import Case, Weights, masks

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: canonical (weight, bias) name -> nn.Linear prefix, for modules built of four nn.Linear
LINEAR_NAMES: dict[tuple[str, str], str] = {
    ("w_q", "b_q"): "q_proj",
    ("w_k", "b_k"): "k_proj",
    ("w_v", "b_v"): "v_proj",
    ("w_o", "b_o"): "out_proj",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name (``float64`` … ``bfloat16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(_DTYPES)}") from None


def check_device(device: str) -> torch.device:
    """``device`` parsed, refusing a CUDA device this machine does not have."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here (torch {torch.__version__})")
    return dev


def to_tensor(array: np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A float64 (or bool) numpy array as a tensor of ``dtype`` on ``device`` (a copy)."""
    tensor = torch.from_numpy(np.array(array, copy=True))
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A result tensor as numpy, values unchanged (bfloat16 comes back as float32, exactly)."""
    tensor = tensor.detach().to("cpu")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.to(torch.float32)  # numpy has no bfloat16; float32 holds every bf16 value
    return tensor.numpy()


def canonical(weights: Weights | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights as a ``{name: float64 array}`` dict (absent biases left out)."""
    items = weights.as_dict() if isinstance(weights, Weights) else dict(weights)
    return {k: np.asarray(v, dtype=np.float64) for k, v in items.items() if v is not None}


def as_float64(tensor: torch.Tensor) -> np.ndarray:
    """A parameter (or its gradient) as a float64 numpy array (exact for every floating dtype)."""
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


def linear_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> ``state_dict`` of a module with four ``nn.Linear``.

    Keys: ``q_proj.weight (H·D_k, d_model)``, ``k_proj.weight (H_kv·D_k, kdim)``,
    ``v_proj.weight (H_kv·D_v, vdim)``, ``out_proj.weight (d_out, H·D_v)``
    (each the transpose of its canonical ``w_*``), and ``*.bias`` = ``b_*``
    when present.  Tensors are float64 on the CPU; ``load_state_dict`` casts.
    """
    w = canonical(weights)
    out: dict[str, torch.Tensor] = {}
    for (w_name, b_name), prefix in LINEAR_NAMES.items():
        out[f"{prefix}.weight"] = torch.from_numpy(np.array(w[w_name].T, order="C"))  # a copy: the case is read-only
        if b_name in w:
            out[f"{prefix}.bias"] = torch.from_numpy(w[b_name].copy())
    return out


def linear_from_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``state_dict`` of a module with four ``nn.Linear`` -> canonical float64 weights."""
    out: dict[str, np.ndarray] = {}
    for (w_name, b_name), prefix in LINEAR_NAMES.items():
        out[w_name] = as_float64(state_dict[f"{prefix}.weight"]).T.copy()
        bias = state_dict.get(f"{prefix}.bias")
        if bias is not None:
            out[b_name] = as_float64(bias)
    return out


def causal_visible(config: Any, tgt_len: Any, src_len: Any, device: torch.device | str) -> torch.Tensor:
    """(T, S) bool, True = may attend: key j visible to query i when j <= i + the causal offset of the
    causal ``config`` (``causal``, ``causal_alignment``: spec/masks.py).  In torch ops, so that an
    exporter tracing the module (T and S may then be traced values) keeps the band in its graph."""
    offset = masks.causal_offset(config, tgt_len, src_len)
    assert offset is not None, "not a causal configuration"
    i = torch.arange(tgt_len, device=device)[:, None]
    j = torch.arange(src_len, device=device)[None, :]
    return j <= i + offset


def visible(case: Case, device: torch.device | str) -> torch.Tensor | None:
    """The spec's mask as a bool tensor, True = may attend: the explicit mask AND the
    causal mask, shaped ``(B|1, 1, T, S)``; None when nothing is masked."""
    cfg, T, S = case.config, case.tgt_len, case.src_len
    allowed = None
    if case.inputs.mask is not None:
        mask = torch.from_numpy(np.array(case.inputs.mask, dtype=bool)).to(device)
        allowed = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if cfg.causal:
        causal = causal_visible(cfg, T, S, device)[None, None]
        allowed = causal if allowed is None else allowed & causal
    return allowed


def top_left_causal_only(case: Case) -> bool:
    """True when the case's only masking is a causal mask that ``is_causal`` (top-left) expresses."""
    cfg = case.config
    return (
        cfg.causal
        and case.inputs.mask is None
        and (cfg.causal_alignment == "top_left" or case.tgt_len == case.src_len)
    )


def autograd_backward(
    case: Case,
    dtype: torch.dtype,
    device: torch.device | str,
    call: Any,
    module: torch.nn.Module,
    to_canonical: Any,
) -> dict[str, np.ndarray]:
    """The backward stages of ``case`` by ``torch.autograd``, in ``dtype``.

    ``call(query, key, value)`` returns the forward's stage tensors by name
    (``output`` required); each intermediate one is kept with ``retain_grad`` and
    comes back as ``d_<stage>``.  The input gradients come from the leaf inputs
    (one leaf per tensor: self-attention's ``d_query`` is the sum of the three,
    shared key/value's ``d_key`` the sum of two, as the spec says); the weight gradients from ``module``'s parameters through
    ``to_canonical`` (the state_dict converter: a gradient has its parameter's layout).
    """
    query = to_tensor(case.inputs.query, dtype, device).requires_grad_()
    key = query if case.self_attention else to_tensor(case.inputs.key, dtype, device).requires_grad_()
    value = key if case.key_is_value else to_tensor(case.inputs.value, dtype, device).requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch.enable_grad():
        stages = call(query, key, value)
        for name, tensor in stages.items():
            if name != "output" and tensor.requires_grad:
                tensor.retain_grad()
        stages["output"].backward(to_tensor(case.d_output, dtype, device))
    out = {f"d_{name}": to_numpy(t.grad) for name, t in stages.items() if name != "output" and t.grad is not None}
    out["d_query"] = to_numpy(query.grad)
    if not case.self_attention:  # one leaf per tensor: a shared one's gradient is the sum (d_key)
        out["d_key"] = to_numpy(key.grad)
        if not case.key_is_value:
            out["d_value"] = to_numpy(value.grad)
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    out.update({f"d_{name}": value for name, value in to_canonical(grads).items()})
    return out
