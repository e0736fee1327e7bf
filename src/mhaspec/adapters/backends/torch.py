"""PyTorch as a backend: dtypes, devices, tensors in and out, the mask in the spec's polarity,
the ``nn.Linear`` weight layout, and the calls every PyTorch adapter makes (a module loaded
with the case's weights, a forward under ``inference_mode``, a backward by autograd).

Layout of ``nn.Linear`` (and of every weight in ``nn.MultiheadAttention``):
``weight`` is ``(out_features, in_features)`` and the layer computes
``y = x @ weight.T + bias``.  The canonical weights are ``(in, out)``
(``y = x @ W + b``), so ``weight = W.T`` and ``bias = b``; the column blocks
of ``W`` that belong to head h become row blocks of ``weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...spec import Case, Weights, masks
from .numpy import weights_in as canonical

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

#: ``call(query, key, value)`` of an adapter: the forward's stage tensors by name (``output`` required)
StagesCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


def dtype(name: str) -> torch.dtype:
    """The torch dtype for a spec dtype name (``float64`` … ``bfloat16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(_DTYPES)}") from None


_dtype = dtype  # for the functions whose argument is named dtype


def check_device(device: str) -> torch.device:
    """``device`` parsed, refusing a CUDA device this machine does not have."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available here (torch {torch.__version__})")
    return dev


def array_in(x: np.ndarray, dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A float64 (or bool) NumPy array as a tensor of ``dtype`` (a spec name or a torch dtype;
    a bool array stays bool) on ``device`` (a copy)."""
    tdt = _dtype(dtype) if isinstance(dtype, str) else dtype
    tensor = torch.from_numpy(np.array(x, copy=True))
    return tensor.to(device=device, dtype=tdt if tensor.is_floating_point() else tensor.dtype)


def array_out(tensor: torch.Tensor) -> np.ndarray:
    """A result tensor as NumPy, values unchanged (bfloat16 comes back as float32, exactly)."""
    tensor = tensor.detach().to("cpu")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.to(torch.float32)  # numpy has no bfloat16; float32 holds every bf16 value
    return tensor.numpy()


def as_float64(tensor: torch.Tensor) -> np.ndarray:
    """A parameter (or its gradient) as a float64 numpy array (exact for every floating dtype)."""
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy().copy()


def weights_in(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
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


def weights_out(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
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


def keep_mask(case: Case, device: torch.device | str) -> torch.Tensor | None:
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


def loaded_module(cls: Any, state_dict: Mapping[str, torch.Tensor], case: Case, device: torch.device | str,
                  **kwargs: Any) -> Any:
    """``cls(**kwargs)`` with parameters made in the case's dtype on ``device`` (no random
    init), loaded with ``state_dict``, in eval mode."""
    module = torch.nn.utils.skip_init(cls, **kwargs, device=device, dtype=_dtype(case.dtype))
    module.load_state_dict(state_dict)
    return module.eval()


def inference(case: Case, device: torch.device | str, call: StagesCall) -> dict[str, np.ndarray]:
    """The forward stages of ``case``: ``call(query, key, value)`` under ``inference_mode``
    on the case's inputs in its dtype (one tensor where the case has one), back as NumPy."""
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype, device))
    with torch.inference_mode():
        stages = call(query, key, value)
    return {name: array_out(t) for name, t in stages.items()}


def autograd_backward(
    case: Case,
    device: torch.device | str,
    call: StagesCall,
    module: torch.nn.Module,
    to_canonical: Callable[[Mapping[str, torch.Tensor]], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The backward stages of ``case`` by ``torch.autograd``, in the case's dtype.

    ``call(query, key, value)`` returns the forward's stage tensors by name
    (``output`` required); each intermediate one is kept with ``retain_grad`` and
    comes back as ``d_<stage>``.  The input gradients come from the leaf inputs
    (one leaf per tensor: self-attention's ``d_query`` is the sum of the three,
    shared key/value's ``d_key`` the sum of two, as the spec says); the weight gradients from
    ``module``'s parameters through ``to_canonical`` (the state_dict converter: a gradient has
    its parameter's layout).
    """
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype, device).requires_grad_())
    module.zero_grad(set_to_none=True)
    with torch.enable_grad():
        stages = call(query, key, value)
        for name, tensor in stages.items():
            if name != "output" and tensor.requires_grad:
                tensor.retain_grad()
        stages["output"].backward(array_in(case.d_output, case.dtype, device))
    out = {f"d_{name}": array_out(t.grad) for name, t in stages.items() if name != "output" and t.grad is not None}
    out["d_query"] = array_out(query.grad)
    if not case.self_attention:  # one leaf per tensor: a shared one's gradient is the sum (d_key)
        out["d_key"] = array_out(key.grad)
        if not case.key_is_value:
            out["d_value"] = array_out(value.grad)
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    out.update({f"d_{name}": value for name, value in to_canonical(grads).items()})
    return out
