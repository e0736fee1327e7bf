"""HF transformers' ``LlamaAttention`` with its ``DynamicCache`` (built-in adapter ``hf-llama-cache``): a
third-party serving path on the decode contract (docs/serving.md), called as ``LlamaModel.forward`` calls
its layers, one call of the schedule at a time.

    call c (n_c rows, cache holding L_(c−1) = past keys before it; self-attention: hidden_states are rows [t0, t1))
      position_ids  = past + arange(n_c)                                        (LlamaModel's default)
      mask          = create_causal_mask(config, hidden_states, padding (B, L_c) | None, cache, position_ids)
      cos, sin      = LlamaRotaryEmbedding(config)(hidden_states, position_ids)  (a case with RoPE)
      output, _     = LlamaAttention(hidden_states, (cos, sin), mask, cache=cache)   appends to the cache

The mask is the one HF builds for that call (``transformers.masking_utils.create_causal_mask``, the
model's own), from the case's key-padding mask as the 2-D ``attention_mask`` a user passes; with no
padding it may be ``None``, and HF's SDPA path then sets ``is_causal`` itself (``q_len > 1 and
attention_mask is None``).  A case without RoPE turns Q and K by cos = 1, sin = 0 (exact: the layer
always applies ``apply_rotary_pos_emb``); a case with RoPE must be Llama's: ``half`` style, every feature
of the head turned, positions from 0 (the model's), any theta.

Weights: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` ``nn.Linear`` ``(out, in)`` = ``w_*.T``, biases
only as ``attention_bias`` (all four or none).  Per call: ``q_proj`` (B, n_c, H·D_k) from the layer's
``q_proj``, ``output`` (B, n_c, d_model), and the cache after the call, ``k_proj`` (``k_rot`` with RoPE)
(B, L_c, H_kv·D_k) and ``v_proj`` (B, L_c, H_kv·D_v) from ``DynamicCache``'s layer 0.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..spec import CATALOG, Case
from ..spec.paging import not_paged
from .backends import declared
from .backends import torch as backend

#: the Llama attention's Linear layers, by the names ``backend.weights_in`` gives them
LLAMA_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}


def llama_state_dict(case: Case) -> dict[str, torch.Tensor]:
    """Canonical weights -> ``LlamaAttention``'s state_dict (``o_proj`` for the output projection)."""
    out = {}
    for name, tensor in backend.weights_in(case.weights).items():  # "q_proj.weight", … "out_proj.bias"
        linear, param = name.split(".")
        out[f"{LLAMA_NAMES[linear]}.{param}"] = tensor
    return out


def llama_config(case: Case) -> Any:
    """The ``LlamaConfig`` of the case's attention: heads, kv heads, head dim, biases, RoPE theta; SDPA."""
    from transformers import LlamaConfig

    c = case.config
    theta = c.rope.theta if c.rope is not None else 10000.0
    config = LlamaConfig(hidden_size=c.d_model, num_attention_heads=c.H, num_key_value_heads=c.H_kv,
                         head_dim=c.D_k, attention_bias=c.bias, num_hidden_layers=1,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    config._attn_implementation = "sdpa"
    return config


def unsupported_reason(case: Case) -> str | None:
    """Why ``LlamaAttention`` with its cache cannot express ``case`` (None: it can)."""
    c = case.config
    if not case.self_attention:
        return ("LlamaAttention is self-attention: one hidden_states for queries, keys and values; "
                "the case has distinct inputs")
    if not c.causal:
        return "LlamaAttention is a decoder's attention, always causal (create_causal_mask); the case is not causal"
    if c.D_k % 2:
        return (f"LlamaConfig refuses an odd head_dim ({c.D_k}): its RoPE validation needs an even rotary dimension, "
                "with or without RoPE in the case")
    if c.D_v != c.D_k:
        return f"LlamaAttention has one head_dim for keys and values; the case has D_k={c.D_k}, D_v={c.D_v}"
    if c.d_out != c.d_model:
        return f"LlamaAttention's o_proj maps back to hidden_size d_model={c.d_model}; the case has d_out={c.d_out}"
    if c.scale != 1.0 / math.sqrt(c.D_k):
        return f"LlamaAttention scales by head_dim**-0.5 = {c.D_k ** -0.5:.6g}; the case asks for scale = {c.scale:g}"
    rope = c.rope
    if rope is not None and (rope.style != "half" or (rope.rotary_dim or c.D_k) != c.D_k
                             or rope.query_offset or rope.key_offset):
        return (f"Llama's RoPE is the half style over the whole head from position 0; the case has {rope.style}, "
                f"rotary_dim={rope.rotary_dim}, offsets {rope.query_offset}/{rope.key_offset}")
    mask = case.inputs.mask
    if mask is not None and (mask.shape[-2] > 1 or mask.shape[-3] > 1):
        return "the model's attention_mask is 2-D (B, keys): key padding only; the case has a per-row or per-head mask"
    return None


def padding_mask(case: Case) -> torch.Tensor | None:
    """The case's key-padding mask as the 2-D ``attention_mask`` (B, S) a user passes (1 = a real token)."""
    mask = case.inputs.mask
    if mask is None:
        return None
    keep = np.broadcast_to(mask.reshape(mask.shape[0], -1), (case.B, case.S))  # (B|1, 1, 1, S) -> (B, S)
    return torch.from_numpy(np.array(keep, dtype=np.int64))


def position_embeddings(case: Case, rotary: Any, hidden: torch.Tensor, position_ids: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (B|1, n, D_k) for the call's rows: the model's ``LlamaRotaryEmbedding``, or the identity turn."""
    if case.config.rope is not None:
        return rotary(hidden, position_ids=position_ids)
    shape = (1, hidden.shape[1], case.config.D_k)
    return torch.ones(shape, dtype=hidden.dtype), torch.zeros(shape, dtype=hidden.dtype)


class HFLlamaCacheAdapter:
    """``transformers``' ``LlamaAttention`` (SDPA) with ``DynamicCache``, the mask and positions as
    ``LlamaModel`` builds them for each call."""

    name = "hf-llama-cache"
    framework = "transformers"
    variants = frozenset({"rope"})
    #: the model's RoPE angles in float32, in the catalog's float64 cases with RoPE
    known_deviations = declared("serving", "hf-llama-cache.rope-float32",
                                cases="|".join(s.id for s in CATALOG if s.config.rope is not None))

    def supports(self, case: Case) -> bool | str:
        return unsupported_reason(case) or not_paged(case)  # a dense cache of its own: no block table

    def _layer(self, case: Case) -> tuple[Any, Any, Any]:
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

        config = llama_config(case)
        layer = LlamaAttention(config, layer_idx=0)
        layer.load_state_dict(llama_state_dict(case))
        return config, layer.to(backend.dtype(case.dtype)).eval(), LlamaRotaryEmbedding(config)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        """One call on the whole case (into a fresh cache), the model's mask and positions."""
        return self._calls(case, [(0, case.T)])[0]

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Each call of the schedule through one ``DynamicCache`` (the module docstring)."""
        return self._calls(case, [(call.t0, call.t1) for call in case.calls()])

    def _calls(self, case: Case, rows: list[tuple[int, int]]) -> list[dict[str, np.ndarray]]:
        """The stages of calls of query rows [t0, t1) each, in order, through one ``DynamicCache``."""
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask

        config, layer, rotary = self._layer(case)
        hidden_states = backend.array_in(case.inputs.query, case.dtype)  # (B, T, d_model)
        padding, cache = padding_mask(case), DynamicCache(config=config)
        key_stage = "k_rot" if case.config.rope is not None else "k_proj"
        out = []
        with torch.inference_mode():
            for t0, t1 in rows:
                hidden = hidden_states[:, t0:t1]  # (B, n, d_model)
                position_ids = (torch.arange(t1 - t0) + cache.get_seq_length())[None]  # (1, n)
                mask = create_causal_mask(config=config, inputs_embeds=hidden,
                                          attention_mask=None if padding is None else padding[:, :t1],
                                          cache=cache, position_ids=position_ids)
                y, _ = layer(hidden, position_embeddings(case, rotary, hidden, position_ids), mask, cache=cache)
                keys, values = cache.layers[0].keys, cache.layers[0].values  # (B, H_kv, L_c, D)
                out.append({"q_proj": backend.array_out(layer.q_proj(hidden)), "output": backend.array_out(y),
                            key_stage: backend.array_out(keys.transpose(1, 2).flatten(2)),
                            "v_proj": backend.array_out(values.transpose(1, 2).flatten(2))})
        return out
