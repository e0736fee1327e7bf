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

from ...spec import Case, Weights, masks, variant_ops
from ...spec.paging import page_slots
from ...spec.stages import BACKWARD_STAGES, STAGE
from . import call_view, packing
from .numpy import sum_to_shape
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

#: the attention sinks' logits (H,): a parameter of that name, as gpt-oss's ``sinks``
SINK_LOGITS = "sink_logits"

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
    (each the transpose of its canonical ``w_*``), ``*.bias`` = ``b_*`` when present, and
    ``sink_logits (H,)`` with sinks.  Tensors are float64 on the CPU; ``load_state_dict`` casts.
    """
    w = canonical(weights)
    out: dict[str, torch.Tensor] = {}
    for (w_name, b_name), prefix in LINEAR_NAMES.items():
        out[f"{prefix}.weight"] = torch.from_numpy(np.array(w[w_name].T, order="C"))  # a copy: the case is read-only
        if b_name in w:
            out[f"{prefix}.bias"] = torch.from_numpy(w[b_name].copy())
    if SINK_LOGITS in w:
        out[SINK_LOGITS] = torch.from_numpy(w[SINK_LOGITS].copy())
    return out


def weights_out(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``state_dict`` of a module with four ``nn.Linear`` -> canonical float64 weights."""
    out: dict[str, np.ndarray] = {}
    for (w_name, b_name), prefix in LINEAR_NAMES.items():
        out[w_name] = as_float64(state_dict[f"{prefix}.weight"]).T.copy()
        bias = state_dict.get(f"{prefix}.bias")
        if bias is not None:
            out[b_name] = as_float64(bias)
    if SINK_LOGITS in state_dict:
        out[SINK_LOGITS] = as_float64(state_dict[SINK_LOGITS])
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


def window_visible(config: Any, tgt_len: int, src_len: int, device: torch.device | str) -> torch.Tensor | None:
    """(T, S) bool of the sliding window of ``config`` (:func:`mhaspec.spec.masks.window_visible`:
    i + off − window_left ≤ j ≤ i + off + window_right), or None without one."""
    band = masks.window_visible(config, tgt_len, src_len)
    return None if band is None else torch.from_numpy(band).to(device)


def keep_mask(case: Case, device: torch.device | str) -> torch.Tensor | None:
    """The spec's mask as a bool tensor, True = may attend: the explicit mask AND the
    causal mask AND the sliding window, shaped ``(B|1, 1, T, S)``; None when nothing is masked."""
    cfg, T, S = case.config, case.tgt_len, case.src_len
    allowed = None
    if case.inputs.mask is not None:
        mask = torch.from_numpy(np.array(case.inputs.mask, dtype=bool)).to(device)
        allowed = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    bands = [causal_visible(cfg, T, S, device) if cfg.causal else None, window_visible(cfg, T, S, device)]
    for band in (b[None, None] for b in bands if b is not None):
        allowed = band if allowed is None else allowed & band
    return allowed


def top_left_causal_only(case: Case) -> bool:
    """True when the case's only masking is a causal mask that ``is_causal`` (top-left) expresses."""
    cfg = case.config
    return (
        cfg.causal
        and case.inputs.mask is None
        and cfg.window_left is None and cfg.window_right is None
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
    bias: torch.Tensor | None = None,
) -> dict[str, np.ndarray]:
    """The backward stages of ``case`` by ``torch.autograd``, in the case's dtype.

    ``call(query, key, value)`` returns the forward's stage tensors by name
    (``output`` required); each intermediate one is kept with ``retain_grad`` and
    comes back as ``d_<stage>`` where that is a backward stage of the spec (``d_q_rot``, ``d_k_rot``
    with RoPE).  The input gradients come from the leaf inputs
    (one leaf per tensor: self-attention's ``d_query`` is the sum of the three,
    shared key/value's ``d_key`` the sum of two, as the spec says); the weight gradients from
    ``module``'s parameters through ``to_canonical`` (the state_dict converter: a gradient has
    its parameter's layout; ``d_sink_logits`` from the ``sink_logits`` parameter).  ``bias``: the leaf
    tensor ``call`` adds to the scores (requiring grad: the case's additive bias input, or a float mask
    built from it), whose gradient summed to the bias input's shape is ``d_bias``.
    """
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype, device).requires_grad_())
    module.zero_grad(set_to_none=True)
    if bias is not None:
        bias.grad = None
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
    if bias is not None and case.inputs.bias is not None:
        out[STAGE.d_bias] = array_out(sum_to_shape(bias.grad, case.inputs.bias.shape))  # (B|1, H|1, T, S)
    return {name: grad for name, grad in out.items() if name in BACKWARD_STAGES}


# -- the attention variants (docs/spec.md §2a) -----------------------------------------------------


def rope_cos_sin(config: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (L, r) in ``dtype``, of the rotary angles at ``positions`` (L,), as Hugging Face's
    rotary embedding (``LlamaRotaryEmbedding``) makes them: inv_freq = 1 / theta^(2k/r) and the angles
    position · inv_freq in float32 (float64 in a float64 case), cos and sin of them cast to ``dtype``;
    each pair's angle on both of its features: ``cat(freqs, freqs)`` in style "half" (the layout of
    ``rotate_half``), each repeated twice in style "interleaved" (GPT-J's pairs 2k, 2k + 1)."""
    spec = config.rope
    r = spec.rotary_dim
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (spec.theta ** (torch.arange(0, r, 2, dtype=torch.int64, device=positions.device).to(work) / r))
    freqs = positions.to(work)[:, None] * inv_freq[None, :]  # (L, r/2)
    angles = torch.cat((freqs, freqs), dim=-1) if spec.style == "half" else freqs.repeat_interleave(2, dim=-1)  # (L, r)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_pairs(x: torch.Tensor, style: str) -> torch.Tensor:
    """(..., r) -> (..., r): each pair (a, b) as (−b, a), so that x·cos + rotate_pairs(x)·sin turns it.
    Style "half": HF's ``rotate_half`` (a = x[k], b = x[k + r/2]); "interleaved": GPT-J's
    ``rotate_every_two`` (a = x[2k], b = x[2k + 1])."""
    if style == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rope(x: torch.Tensor, heads: int, positions: torch.Tensor, config: Any) -> torch.Tensor:
    """x (B, L, heads·D) turned by RoPE at ``positions`` (L,) in x's dtype: each head's first
    ``rotary_dim`` features become x·cos + rotate_pairs(x)·sin, the rest pass through.  -> (B, L, heads·D)."""
    B, L, F = x.shape
    r = config.rope.rotary_dim
    h = x.reshape(B, L, heads, F // heads)  # (B, L, heads, D)
    cos, sin = (t[None, :, None, :] for t in rope_cos_sin(config, positions, x.dtype))  # (1, L, 1, r)
    turning, passing = h[..., :r], h[..., r:]
    turned = turning * cos + rotate_pairs(turning, config.rope.style) * sin
    return torch.cat((turned, passing), dim=-1).reshape(B, L, F)


def rope_qk(config: Any, q: torch.Tensor, k: torch.Tensor, q_start: int = 0, k_start: int = 0,
            positions: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot (B, T, H·D_k), k_rot (B, S, H_kv·D_k)): q_proj and k_proj turned at the case's positions
    (query_offset + q_start + i, key_offset + k_start + j: :func:`mhaspec.spec.variant_ops.rope_positions`;
    the starts are a call's first query row and the cache length before it, 0 in a whole pass), or at
    ``positions`` (T,), (S,) (a packed call's: :func:`mhaspec.adapters.backends.packing.packed_positions`)."""
    if positions is None:
        q_pos, k_pos = variant_ops.rope_positions(config, q.shape[1], k.shape[1], row_offset=q_start)
        positions = q_pos, k_pos + k_start
    q_pos, k_pos = (torch.from_numpy(p).to(q.device) for p in positions)
    return rope(q, config.H, q_pos, config), rope(k, config.H_kv, k_pos, config)


def softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(scores / cap), element-wise in the scores' dtype (Gemma 2's ``attn_logit_softcapping``)."""
    return cap * torch.tanh(scores / cap)


def alibi(config: Any, tgt_len: int, src_len: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """(H, T, S) in ``dtype``: −slope_h · |i + off − j| (:func:`mhaspec.spec.variant_ops.alibi`, float64,
    rounded once to ``dtype``); None without ALiBi."""
    term = variant_ops.alibi(config, tgt_len, src_len, tgt_len)
    return None if term is None else torch.from_numpy(term).to(device=device, dtype=dtype)


def score_bias(case: Case, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """(B|1, H|1, T, S) in ``dtype``: the case's additive ``bias`` input plus its ALiBi term, summed in
    float64 and rounded once; None when the case has neither."""
    bias, term = case.inputs.bias, variant_ops.alibi(case.config, case.T, case.S, case.T)
    if bias is None and term is None:
        return None
    total = (0.0 if bias is None else bias) + (0.0 if term is None else term[None])  # (B|1, H|1, T, S)
    return torch.from_numpy(np.array(total, dtype=np.float64)).to(device=device, dtype=dtype)


def additive_mask(case: Case, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """(B|1, H|1, T, S) float in ``dtype``, the additive ``attn_mask`` SDPA adds to its scaled scores:
    :func:`score_bias` where a key is visible (:func:`keep_mask`), −inf where it is not; None when the
    case has no bias, no ALiBi and no mask."""
    bias, allowed = score_bias(case, dtype, device), keep_mask(case, device)
    if allowed is None:
        return bias
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero if bias is None else bias, float("-inf"))


def packed_masks(case: Case, additive: bool, device: torch.device | str) -> torch.Tensor:
    """A packed case's (1, H, N, N) ``attn_mask`` for its one (1, N) call: the block-diagonal rule of
    ``case.cu_seqlens()`` (:func:`mhaspec.adapters.backends.packing.packed_allowed`) as a bool mask (True =
    take part), or ``additive``: each sequence's bias and ALiBi term (summed in float64, rounded once) where
    visible, −inf elsewhere, in the case's dtype."""
    allowed = torch.from_numpy(packing.packed_allowed(case)).to(device)
    if not additive:
        return allowed
    dt, bias = dtype(case.dtype), packing.packed_score_bias(case)
    zero = torch.zeros((), dtype=dt, device=device)
    return torch.where(allowed, zero if bias is None else torch.from_numpy(bias).to(device=device, dtype=dt), float("-inf"))


def packed_inference(case: Case, device: torch.device | str, call: StagesCall) -> dict[str, np.ndarray]:
    """A packed case's forward stages: ``call(query, key, value)`` under ``inference_mode`` on the valid rows of
    every entry in one (1, N) batch, N = Σ l_b (the padding rows, NaN, are never read), back as NumPy in the
    padded layout (B, T, ·) (:func:`mhaspec.adapters.backends.packing.unpack`)."""
    index = torch.from_numpy(packing.packed_rows(case)).to(device)

    def packed(x: np.ndarray) -> torch.Tensor:  # (B, T, F) -> (1, N, F)
        t = array_in(x, case.dtype, device)
        return t.reshape(-1, t.shape[-1]).index_select(0, index)[None]

    query, key, value = case.inputs_as(packed)
    with torch.inference_mode():
        stages = call(query, key, value)
    return packing.unpack(case, {name: array_out(t) for name, t in stages.items()})


class FusedAttentionModule(torch.nn.Module):
    """The parts of a module built around one fused attention call (SDPA, FlexAttention): four
    ``nn.Linear`` (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``: W^Q, W^K, W^V, W^O) and, with
    sinks, their logits ``sink_logits`` (H,) — the state dict of :func:`weights_in` — with the steps
    before and after the call (:meth:`project`, :meth:`merge`).  ``config`` fixes the sizes, the
    scale, RoPE and the sinks."""

    def __init__(self, config: Any, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cfg = self.config = config
        factory = {"device": device, "dtype": dtype}
        kdim, vdim = int(cfg.kdim), int(cfg.vdim)
        self.q_proj = torch.nn.Linear(cfg.d_model, cfg.H * cfg.D_k, bias=cfg.bias, **factory)  # W^Q
        self.k_proj = torch.nn.Linear(kdim, cfg.H_kv * cfg.D_k, bias=cfg.bias, **factory)  # W^K
        self.v_proj = torch.nn.Linear(vdim, cfg.H_kv * cfg.D_v, bias=cfg.bias, **factory)  # W^V
        self.out_proj = torch.nn.Linear(cfg.H * cfg.D_v, cfg.d_out, bias=cfg.bias, **factory)  # W^O
        self.sink_logits = torch.nn.Parameter(torch.empty(cfg.H, **factory)) if cfg.sinks else None  # (H,)

    def project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: KVCache | None = None,
                q_start: int = 0, positions: tuple[np.ndarray, np.ndarray] | None = None
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim) -> (the stages q_proj, k_proj,
        v_proj, and q_rot, k_rot with RoPE; Q (B, H, T, D_k), K (B, H_kv, S, D_k), V (B, H_kv, S, D_v))
        (:func:`project`; with a ``cache``, the key-side stages, K and V are the whole cache's; ``positions``:
        RoPE's, :func:`rope_qk`)."""
        stages, q, k, v = project(self, self.config, query, key, value, cache, q_start, positions)
        return stages, *split_heads(self.config, q, k, v)

    def merge(self, head_outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """head_outputs (B, H, T, D_v) -> the stages head_outputs, concat (B, T, H·D_v) and output (B, T, d_out)."""
        B, H, T, E = head_outputs.shape
        concat = head_outputs.transpose(1, 2).reshape(B, T, H * E)  # (B, T, H·E)
        return {"head_outputs": head_outputs, "concat": concat, "output": self.out_proj(concat)}


# -- a call of a schedule against the adapter's own KV cache (docs/serving.md) -------------------------------

#: the key-side stages a :class:`KVCache` holds, each (B, L, ·), L the rows fed so far
CACHED = ("k_proj", "k_rot", "v_proj")


class KVCache:
    """A hand-written KV cache: the projected keys ``k_proj`` (B, L, H_kv·D_k), with RoPE the turned keys
    ``k_rot`` (what attention reads; k_proj is kept beside them so that a call can return the cache's
    contents at every key-side stage), and the values ``v_proj`` (B, L, H_kv·D_v), in the dtype, of the L
    key rows fed so far; each call appends its new rows along L (``torch.cat``)."""

    def __init__(self) -> None:
        self.stages: dict[str, torch.Tensor] = {}

    @property
    def length(self) -> int:
        """L, the key rows in the cache."""
        return 0 if not self.stages else self.stages["k_proj"].shape[1]

    def append(self, new: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new rows' key-side stages (B, n, ·) appended -> the whole cache (B, L + n, ·) by stage name."""
        for name in CACHED:
            if name in new:
                held = self.stages.get(name)
                self.stages[name] = new[name] if held is None else torch.cat((held, new[name]), dim=1)
        return dict(self.stages)


class PagedKVCache(KVCache):
    """A paged cache (docs/serving.md "Paged caches"): per key-side stage one pool (num_pages, page_size, F)
    in the dtype, F = H_kv·D (vLLM's (num_pages, page_size, H_kv, D) with the heads flattened), shared by
    the batch entries; key j of entry b is written to and read from page ``block_table[b][j // page_size]``,
    slot ``j % page_size`` (:func:`mhaspec.spec.paging.page_slots`).  Each call scatters its new rows into
    their slots and gathers the whole cache (B, L, ·) through the table, in logical order."""

    def __init__(self, case: Case, device: torch.device | str) -> None:
        super().__init__()
        assert case.page_size is not None and case.num_pages is not None, "PagedKVCache: not a paged case"
        self.table, self.page_size, self.num_pages = case.block_table, case.page_size, case.num_pages
        self.device = device
        self.pools: dict[str, torch.Tensor] = {}  # name -> (N, page_size, F)

    def _where(self, keys: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool pages (B, n), slots (1, n)) of the logical keys ``keys``, as index tensors."""
        pages, slots = page_slots(self.table, self.page_size, keys)
        return torch.as_tensor(pages, device=self.device), torch.as_tensor(slots, device=self.device)[None, :]

    def append(self, new: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new rows' key-side stages (B, n, ·) written to their pages -> the whole cache (B, L + n, ·)
        gathered through the table."""
        start, end = self.length, self.length + new["k_proj"].shape[1]
        written, held = self._where(slice(start, end)), self._where(slice(0, end))
        for name in CACHED:
            if name in new:
                x = new[name]  # (B, n, F)
                pool = self.pools.setdefault(name, x.new_zeros(self.num_pages, self.page_size, x.shape[-1]))
                pool[written] = x
                self.stages[name] = pool[held]  # (B, L, F)
        return dict(self.stages)


def project(module: torch.nn.Module, config: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            cache: KVCache | None = None, q_start: int = 0, positions: tuple[np.ndarray, np.ndarray] | None = None
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``module``'s four projections' first three (``q_proj``, ``k_proj``, ``v_proj``) and RoPE: query
    (B, T, d_model), key (B, S, kdim), value (B, S, vdim) -> (the stages q_proj, k_proj, v_proj, with RoPE
    q_rot and k_rot; q (B, T, H·D_k), k (B, S, H_kv·D_k), v (B, S, H_kv·D_v), what attention reads).

    With a ``cache``, key and value are the rows a call appends: they are turned at their cache positions
    (from ``cache.length``), the queries at ``q_start`` (the call's first row), and the key-side stages,
    k and v are the whole cache after the append (B, L, ·)."""
    stages: dict[str, torch.Tensor] = {}
    q = stages["q_proj"] = module.q_proj(query)  # (B, T, H·D)
    stages["k_proj"] = module.k_proj(key)  # (B, S, G·D)
    stages["v_proj"] = module.v_proj(value)  # (B, S, G·E)
    if config.rope is not None:
        q, stages["k_rot"] = rope_qk(config, q, stages["k_proj"], q_start, 0 if cache is None else cache.length,
                                     positions)
        stages["q_rot"] = q
    if cache is not None:
        stages.update(cache.append(stages))  # (B, L, ·)
    k = stages["k_rot"] if config.rope is not None else stages["k_proj"]
    return stages, q, k, stages["v_proj"]


def split_heads(config: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, T, H·D_k), k (B, S, H_kv·D_k), v (B, S, H_kv·D_v) -> Q (B, H, T, D_k), K (B, H_kv, S, D_k),
    V (B, H_kv, S, D_v): head h owns features [h·D, (h+1)·D)."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    return (q.view(B, T, config.H, config.D_k).transpose(1, 2), k.view(B, S, config.H_kv, config.D_k).transpose(1, 2),
            v.view(B, S, config.H_kv, config.D_v).transpose(1, 2))


#: ``step(view, query, key, value, cache, q_start)`` of an adapter: one call's stage tensors by name —
#: ``view`` the case as the call sees it (:func:`mhaspec.adapters.backends.call_view`: its masks and
#: biases), query (B, n_c, d_model) the call's rows, key and value the rows it appends to ``cache``,
#: q_start its first query row
DecodeStep = Callable[[Case, torch.Tensor, torch.Tensor, torch.Tensor, KVCache, int], dict[str, torch.Tensor]]


def decode(case: Case, device: torch.device | str, step: DecodeStep) -> list[dict[str, np.ndarray]]:
    """The stages of each call of ``case``'s schedule (:meth:`mhaspec.spec.Case.calls`), in order, under
    ``inference_mode`` against one :class:`KVCache` (a paged case's: :class:`PagedKVCache`): call c gives
    ``step`` query rows [t0, t1) and key/value rows [L_(c−1), L_c) (call 0: the past too, [0, L_0)) in the
    case's dtype; back as NumPy."""
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype, device))
    cache, out = (KVCache() if case.page_size is None else PagedKVCache(case, device)), []
    with torch.inference_mode():
        for call in case.calls():
            new = slice(cache.length, call.cache)  # the key rows this call appends
            stages = step(call_view(case, call), query[:, call.t0:call.t1], key[:, new], value[:, new], cache, call.t0)
            out.append({name: array_out(t) for name, t in stages.items()})
    return out
