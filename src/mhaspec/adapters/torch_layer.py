"""Multi-head attention as a plain ``torch.nn.Module``, returning every stage
(built-in adapter ``torch``), with every attention variant of docs/spec.md §2a.

    query (B, T, d_model)   key (B, S, kdim)   value (B, S, vdim)
        │ q_proj                │ k_proj           │ v_proj          four nn.Linear:
        ▼                       ▼                  ▼                 W^Q, W^K, W^V, W^O
    q (B, T, H·D)           k (B, S, G·D)      v (B, S, G·E)
        │ rope (q_rot)          │ rope (k_rot)     │                 HF's rotate_half / GPT-J's pairs
        │ split heads           │ split, repeat    │ split, repeat   head h reads kv head h // (H/G)
        ▼                       ▼                  ▼
    Q (B, H, T, D)  ──►  scores = scale · Q Kᵀ → softcap → + bias − slope·|i + off − j|  (B, H, T, S)
                            │ mask (True = may attend) AND causal AND window;
                            │ softmax over S with the sink logit as one more column (lse: its log-sum-exp)
                            ▼
                     attn_weights (B, H, T, S)  ──►  head_outputs = attn_weights · V (B, H, T, E)
                                                         │ concat heads
                                                         ▼
                                                    concat (B, T, H·E) ──out_proj──► output (B, T, d_out)

:class:`MultiHeadAttention` is a reusable module (kdim/vdim, D_v != D_k,
d_out, GQA/MQA, masks, causal in both alignments, windows, softcap, ALiBi, an
additive bias, sinks, RoPE).  Its ``state_dict`` has ``q_proj``, ``k_proj``,
``v_proj``, ``out_proj`` (``nn.Linear``: ``weight`` is ``(out, in)``,
``y = x @ weight.T + bias``) and, with sinks, ``sink_logits`` (H,);
:func:`canonical_to_state_dict` and :func:`state_dict_to_canonical` convert
from and to the canonical weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..spec import Case, MHAConfig, Weights
from ..spec.stages import REGISTRY
from ..spec.variants import CONFIG_VARIANT_DEFAULTS as VARIANT_FIELDS
from ..spec.variants import VARIANTS
from .backends import torch as backend


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> :class:`MultiHeadAttention` ``state_dict``.

    ``q_proj.weight = w_q.T (H·D_k, d_model)``, ``k_proj.weight = w_k.T (H_kv·D_k, kdim)``,
    ``v_proj.weight = w_v.T (H_kv·D_v, vdim)``, ``out_proj.weight = w_o.T (d_out, H·D_v)``,
    ``*.bias = b_*``, ``sink_logits (H,)`` with sinks.  float64 CPU tensors; ``load_state_dict`` casts them.
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
    ``return_stages=True`` a dict of every stage (``q_proj`` … ``output``, with
    ``q_rot`` and ``k_rot`` under RoPE, and ``lse``).
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
        **variants: Any,
    ) -> None:
        """``variants``: the variant fields of :class:`MHAConfig` (``window_left``, ``window_right``,
        ``softcap``, ``alibi_slopes``, ``sinks``, ``rope``; docs/spec.md §2a)."""
        super().__init__()
        cfg = MHAConfig(
            d_model=d_model, num_heads=num_heads, kdim=kdim, vdim=vdim, num_kv_heads=num_kv_heads,
            head_dim=head_dim, value_head_dim=value_head_dim, out_dim=out_dim, bias=bias, scale=scale,
            causal=causal, causal_alignment=causal_alignment, **variants,  # type: ignore[arg-type]
        )
        self.config = cfg
        factory = {"device": device, "dtype": dtype}
        kdim, vdim = int(cfg.kdim), int(cfg.vdim)  # type: ignore[arg-type]
        self.q_proj = nn.Linear(cfg.d_model, cfg.H * cfg.D_k, bias=bias, **factory)  # W^Q
        self.k_proj = nn.Linear(kdim, cfg.H_kv * cfg.D_k, bias=bias, **factory)  # W^K
        self.v_proj = nn.Linear(vdim, cfg.H_kv * cfg.D_v, bias=bias, **factory)  # W^V
        self.out_proj = nn.Linear(cfg.H * cfg.D_v, cfg.d_out, bias=bias, **factory)  # W^O
        self.sink_logits = nn.Parameter(torch.empty(cfg.H, **factory)) if cfg.sinks else None  # (H,)

    @classmethod
    def from_config(cls, config: MHAConfig, **factory: Any) -> MultiHeadAttention:
        """A module for ``config`` (``factory``: ``device``, ``dtype``)."""
        return cls(**config.model_dump(), **factory)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"H={c.H}, H_kv={c.H_kv}, D_k={c.D_k}, D_v={c.D_v}, scale={c.scale:g}, "
            f"causal={c.causal}" + (f" ({c.causal_alignment})" if c.causal else "")
            + "".join(f", {name}={getattr(c, name)}" for name, off in VARIANT_FIELDS.items() if getattr(c, name) != off)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        *,
        return_stages: bool = False,
        cache: backend.KVCache | None = None,
        q_start: int = 0,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim) — key and value
        default to query; mask: bool broadcastable to (B, H, T, S), True = may attend
        (the polarity of ``F.scaled_dot_product_attention``); bias: the additive score
        bias (B|1, H|1, T, S), added after the softcap (docs/spec.md §2a).

        With a ``cache`` (:class:`~.backends.torch.KVCache`, docs/serving.md): key and value are the rows
        appended to it, query's first row is row ``q_start`` of the sequence, and attention reads the whole
        cache: S is its length after the append (mask and bias are given for those S keys), the causal
        diagonal bottom-right; the key-side stages are the cache's contents."""
        cfg = self.config
        key = query if key is None else key
        value = key if value is None else value

        # 1. Project (and turn), then split heads: head h owns features [h·D, (h+1)·D).
        stages, q, k, v = backend.project(self, cfg, query, key, value, cache, q_start)
        Q, K, V = backend.split_heads(cfg, q, k, v)  # (B, H, T, D), (B, G, S, D), (B, G, S, E)
        B, T, S = Q.shape[0], Q.shape[2], K.shape[2]
        K = K.repeat_interleave(cfg.group_size, dim=1)  # (B, H, S, D): head h reads kv head h // (H/G)
        V = V.repeat_interleave(cfg.group_size, dim=1)  # (B, H, S, E)

        # 2. Attend: the logits (scaled dot products, softcap, bias and ALiBi), the masked softmax
        #    over S with the sinks, the weighted sum of values.
        scores = stages["scores"] = self._logits(Q, K, bias)  # (B, H, T, S)
        allowed = self._visible(mask, T, S, query.device)
        attn_weights, stages["lse"] = softmax_with_sinks(scores, allowed, self.sink_logits)
        head_outputs = attn_weights @ V  # (B, H, T, E)

        # 3. Concat heads in head order, then the output projection.
        concat = head_outputs.transpose(1, 2).reshape(B, T, cfg.H * cfg.D_v)  # (B, T, H·E)
        output = self.out_proj(concat)  # (B, T, d_out)
        if not return_stages:
            return output
        stages.update(attn_weights=attn_weights, head_outputs=head_outputs, concat=concat, output=output)
        return {name: stages[name] for name in REGISTRY if name in stages}  # pipeline order

    def _logits(self, Q: torch.Tensor, K: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Q (B, H, T, D), K (B, H, S, D) -> the logits the softmax sees (B, H, T, S):
        scale · Q Kᵀ, then softcap, then + bias and ALiBi (docs/spec.md "Order of operations")."""
        cfg = self.config
        scores = (Q @ K.transpose(-2, -1)) * cfg.scale  # (B, H, T, S)
        if cfg.softcap is not None:
            scores = backend.softcap(scores, cfg.softcap)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)  # (B|1, H|1, T, S)
        term = backend.alibi(cfg, Q.shape[2], K.shape[2], scores.dtype, scores.device)  # (H, T, S)
        return scores if term is None else scores + term

    def _visible(self, mask: torch.Tensor | None, T: int, S: int, device: torch.device) -> torch.Tensor | None:
        """The explicit mask AND the causal mask AND the window (True = may attend), or None."""
        cfg = self.config
        allowed = None if mask is None else mask.to(device=device, dtype=torch.bool)
        bands = [backend.causal_visible(cfg, T, S, device) if cfg.causal else None,
                 backend.window_visible(cfg, T, S, device)]
        for band in (b for b in bands if b is not None):
            allowed = band if allowed is None else allowed & band
        return allowed


def softmax_with_sinks(
    scores: torch.Tensor, allowed: torch.Tensor | None, sink_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attn_weights (B, H, T, S), lse (B, H, T)) of the logits ``scores`` (B, H, T, S), where
    ``allowed`` (broadcastable, True = may attend; None: every key) and with the sinks' logits
    ``sink_logits`` (H,) as one more column of each row, as gpt-oss computes it (softmax over
    S + 1 columns, the sink's dropped): rows then sum to less than 1.  lse is the natural
    log-sum-exp of the row, sink included.  Masked entries are 0 and a row that sees no key is
    all 0 with lse −inf, with or without a sink (softmax alone gives NaN there)."""
    B, H, T, S = scores.shape
    logits = scores if allowed is None else scores.masked_fill(~allowed, float("-inf"))
    if sink_logits is not None:
        sink = sink_logits.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        logits = torch.cat((logits, sink), dim=-1)  # (B, H, T, S + 1)
    attn_weights = torch.softmax(logits, dim=-1)[..., :S]  # (B, H, T, S)
    # in float32 (float64 for float64), as softmax sums internally: torch.logsumexp of a float16/bfloat16
    # tensor rounds x − max, each exp, their sum and its log to that dtype (docs/torch.md)
    lse = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).to(scores.dtype)
    if allowed is None:
        return attn_weights, lse
    sees_none = ~allowed.any(dim=-1)  # (B|1, H|1, T)
    return attn_weights.masked_fill(~allowed, 0.0), lse.masked_fill(sees_none, float("-inf"))


class TorchMHAAdapter:
    """The ``torch`` adapter: :class:`MultiHeadAttention` loaded with the case's weights, every variant."""

    name = "torch"
    framework = "torch"
    variants = frozenset(VARIANTS)

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def _module(self, case: Case) -> MultiHeadAttention:
        return backend.loaded_module(MultiHeadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     **case.config.model_dump())

    def _inputs(self, case: Case) -> dict[str, torch.Tensor | None]:
        """The case's mask (bool) and additive bias (in its dtype, (B|1, H|1, T, S)) as ``forward`` takes them."""
        mask, bias = case.inputs.mask, case.inputs.bias
        return {"mask": None if mask is None else backend.array_in(mask, torch.bool, self.device),
                "bias": None if bias is None else backend.array_in(bias, case.dtype, self.device)}

    def _call(self, module: MultiHeadAttention, case: Case, bias: torch.Tensor | None = None) -> backend.StagesCall:
        """``module``'s forward with the case's mask and additive bias (``bias``, else the case's in its
        dtype), every stage returned."""
        given = self._inputs(case)
        mask, bias = given["mask"], given["bias"] if bias is None else bias

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, mask=mask, bias=bias, return_stages=True)

        return call

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return backend.inference(case, self.device, self._call(self._module(case), case))

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Every stage of each call of the case's schedule (docs/serving.md) against a hand-written
        :class:`~.backends.torch.KVCache` in the dtype: each call projects its new key/value rows, turns them
        at their cache positions, appends them, and attends with its queries over the whole cache (the
        bottom-right diagonal of n_c rows over L_c keys, the window, the mask's and bias's rows and keys of
        the call).  Per call: q_proj (q_rot), the cache's k_proj (k_rot) and v_proj, scores, attn_weights,
        lse, head_outputs, concat, output."""
        module = self._module(case)

        def step(view: Case, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: backend.KVCache,
                 q_start: int) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, **self._inputs(view), return_stages=True, cache=cache,
                          q_start=q_start)

        return backend.decode(case, self.device, step)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``torch.autograd``: intermediate stages (q_rot, k_rot, scores …) through
        ``retain_grad``, d_sink_logits from the ``sink_logits`` parameter, d_bias from the bias input
        passed as a leaf that requires grad."""
        module = self._module(case)
        bias = None if case.inputs.bias is None else (
            backend.array_in(case.inputs.bias, case.dtype, self.device).requires_grad_())  # (B|1, H|1, T, S)
        return backend.autograd_backward(case, self.device, self._call(module, case, bias), module,
                                         state_dict_to_canonical, bias=bias)
