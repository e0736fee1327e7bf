"""``torch.nn.functional.scaled_dot_product_attention`` between ``nn.Linear``
projections (built-in adapter ``torch-sdpa``), with the attention variants SDPA can express.

    query ─q_proj─(rope: q_rot)─► split heads ─┐
    key   ─k_proj─(rope: k_rot)─► split heads ─┼─► F.scaled_dot_product_attention ─► head_outputs (B, H, T, E)
    value ─v_proj───────────────► split heads ─┘     (attn_mask; is_causal;             │ concat heads
                                                       scale; enable_gqa)                ▼
                                                                          concat ─out_proj─► output

SDPA is fused: ``scores``, ``attn_weights`` and ``lse`` are not exposed.  Its
``is_causal`` is top-left aligned, and it refuses ``is_causal`` together with
an ``attn_mask``: a bottom-right (T != S), windowed or masked causal case gets
the combined boolean mask instead.  The variants, as SDPA takes them:

* the additive ``bias`` input and ALiBi: a float ``attn_mask`` (added to the
  scaled scores), bias − slope·|i + off − j| where a key is visible, −inf where not;
* a sliding window: in the mask (causal AND window AND the explicit mask);
* RoPE: applied to q_proj and k_proj before SDPA (stages ``q_rot``, ``k_rot``);
* sinks: one more key column whose score is the sink's logit — key 0 (its dot
  product with every query is 0), value 0 (it adds nothing to the output) and
  ``attn_mask`` = sink_h in that column — so SDPA's own softmax has the sink in
  its denominator;
* softcap: not expressible (SDPA has no hook between the scaled scores and the
  mask's addition): not declared, so those cases are ``unsupported``.

Backward (``torch.autograd`` through SDPA's own): every gradient but ``d_scores`` and ``d_attn_weights``
(inside the fused call); ``d_sink_logits`` is the ``sink_logits`` parameter's, through the sink column;
``d_bias`` is the gradient of the float ``attn_mask`` passed as a leaf (``attn_mask=mask.requires_grad_()``,
as a user learning a bias does), summed to the bias input's shape.

Weights: the ``state_dict`` is the same as
:class:`mhaspec.adapters.torch_layer.MultiHeadAttention`'s (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``; ``weight`` is ``(out, in)``; ``sink_logits`` (H,) with sinks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..spec import Case, Weights
from ..spec.variants import VARIANTS
from .backends import packing
from .backends import torch as backend


def canonical_to_state_dict(weights: Weights | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> :class:`SDPAMultiHeadAttention` ``state_dict``:
    ``q_proj.weight = w_q.T``, ``k_proj.weight = w_k.T``, ``v_proj.weight = w_v.T``,
    ``out_proj.weight = w_o.T`` (each ``(out, in)``), ``*.bias = b_*``, ``sink_logits`` with sinks."""
    return backend.weights_in(weights)


def state_dict_to_canonical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """:class:`SDPAMultiHeadAttention` ``state_dict`` -> canonical float64 weights."""
    return backend.weights_out(state_dict)


class SDPAMultiHeadAttention(backend.FusedAttentionModule):
    """Four ``nn.Linear`` (and the sinks' logits) around ``F.scaled_dot_product_attention``.

    ``config`` fixes the sizes, the scale, RoPE and the sinks; masking, the additive bias and
    ALiBi are SDPA's ``attn_mask`` (and ``is_causal``), passed through by ``forward``.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        cache: backend.KVCache | None = None,
        q_start: int = 0,
        positions: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> dict[str, torch.Tensor]:
        """query (B, T, d_model), key (B, S, kdim), value (B, S, vdim); attn_mask and
        is_causal as ``F.scaled_dot_product_attention`` takes them (a float mask with sinks).
        With a ``cache`` (:class:`~.backends.torch.KVCache`): key and value are the rows appended to it,
        query's first row is row ``q_start`` of the sequence, and SDPA reads the whole cache (S = its length
        after the append; the mask is then (B|1, H|1, T, S) for those keys).  ``positions``: RoPE's (a packed
        call's, each sequence's own).
        Returns the stages it sees: q_proj, k_proj, v_proj, (q_rot, k_rot,) head_outputs, concat, output."""
        cfg = self.config
        stages, Q, K, V = self.project(query, key, value, cache, q_start, positions)  # (B, H, T, D), (B, G, S, D), (B, G, S, E)
        if self.sink_logits is not None:
            K, V, attn_mask = with_sink_column(K, V, attn_mask, self.sink_logits, Q.shape[2])  # S + 1 keys
        head_outputs = F.scaled_dot_product_attention(
            query=Q, key=K, value=V, attn_mask=attn_mask, is_causal=is_causal, scale=cfg.scale,
            **({"enable_gqa": True} if cfg.H_kv != cfg.H else {}),  # keyword exists from torch 2.5
        )  # (B, H, T, E)
        return {**stages, **self.merge(head_outputs)}


def with_sink_column(
    K: torch.Tensor, V: torch.Tensor, attn_mask: torch.Tensor | None, sink_logits: torch.Tensor, tgt_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sinks as one more key for SDPA: K (B, G, S, D) and V (B, G, S, E) with a zero key and a
    zero value appended (S + 1), and the float ``attn_mask`` (B|1, H|1, T, S) or None with the column
    sink_h appended -> (B|1, H, T, S + 1).  The sink's score is then scale·q·0 + sink_h = sink_h, in
    the softmax's denominator, and its weight multiplies a zero value.  A row that sees no key gives
    the sink all its weight: head_outputs 0, as the spec says."""
    B, G, S, _ = K.shape
    H = sink_logits.shape[0]
    K = torch.cat((K, K.new_zeros(B, G, 1, K.shape[-1])), dim=2)  # (B, G, S + 1, D)
    V = torch.cat((V, V.new_zeros(B, G, 1, V.shape[-1])), dim=2)  # (B, G, S + 1, E)
    if attn_mask is None:
        attn_mask = K.new_zeros(1, 1, tgt_len, S)
    if attn_mask.dtype == torch.bool:
        raise TypeError("with_sink_column: attn_mask must be a float (additive) mask, got bool")
    mask = attn_mask.expand(attn_mask.shape[0], H, tgt_len, S)  # (B|1, H, T, S)
    sink = sink_logits.to(mask.dtype).view(1, H, 1, 1).expand(mask.shape[0], H, tgt_len, 1)
    return K, V, torch.cat((mask, sink), dim=-1)  # (B|1, H, T, S + 1)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


class TorchSDPAAdapter:
    """The ``torch-sdpa`` adapter."""

    name = "torch-sdpa"
    framework = "torch"
    #: every variant but softcap, which SDPA cannot express (module docstring)
    variants = frozenset(VARIANTS) - {"softcap"}
    packed = True  # run(case) of a packed case: one SDPA call over the packed rows (_packed)

    def __init__(self, device: str = "cpu") -> None:
        self.device = backend.check_device(device)

    def supports(self, case: Case) -> bool | str:
        if case.config.H_kv != case.config.H and _torch_version() < (2, 5):
            return f"grouped-query attention needs SDPA's enable_gqa (torch >= 2.5; this is {torch.__version__})"
        return True

    def _module(self, case: Case) -> SDPAMultiHeadAttention:
        return backend.loaded_module(SDPAMultiHeadAttention, canonical_to_state_dict(case.weights), case, self.device,
                                     config=case.config)

    @staticmethod
    def _additive(case: Case) -> bool:
        """Whether SDPA's ``attn_mask`` is a float mask: with a bias input, ALiBi or sinks."""
        cfg = case.config
        return case.inputs.bias is not None or cfg.alibi_slopes is not None or cfg.sinks

    def _masks(self, case: Case) -> dict[str, Any]:
        """SDPA's ``attn_mask`` and ``is_causal`` for the case's masking, bias and ALiBi."""
        if self._additive(case):  # float: bias − slope·distance where visible, −inf where not
            mask = backend.additive_mask(case, backend.dtype(case.dtype), self.device)  # (B|1, H|1, T, S)
            return {"attn_mask": mask, "is_causal": False}
        if backend.top_left_causal_only(case):  # SDPA's is_causal is top-left and excludes attn_mask
            return {"attn_mask": None, "is_causal": True}
        return {"attn_mask": backend.keep_mask(case, self.device), "is_causal": False}  # bool, True = take part

    def _call(self, module: SDPAMultiHeadAttention, masks: dict[str, Any]) -> backend.StagesCall:
        """``module``'s forward with SDPA's ``masks`` (:meth:`_masks`)."""

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, **masks)

        return call

    def run(self, case: Case) -> dict[str, np.ndarray]:
        if case.seq_lens is not None:
            return self._packed(case)
        return backend.inference(case, self.device, self._call(self._module(case), self._masks(case)))

    def _packed(self, case: Case) -> dict[str, np.ndarray]:
        """A packed case (docs/serving.md): SDPA over one (1, N = Σ l_b) batch of the valid rows with the
        block-diagonal (+ causal, window, mask) ``attn_mask`` of ``case.cu_seqlens()``, RoPE at each sequence's
        own positions; the stages back in the padded layout."""
        module = self._module(case)
        masks = {"attn_mask": backend.packed_masks(case, self._additive(case), self.device), "is_causal": False}
        positions = packing.packed_positions(case) if case.config.rope is not None else None

        def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, positions=positions, **masks)

        return backend.packed_inference(case, self.device, call)

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """The stages of each call of the case's schedule (docs/serving.md) against a hand-written
        :class:`~.backends.torch.KVCache` in the dtype: each call projects its new key/value rows, turns them
        at their cache positions, appends them, and calls SDPA with the call's queries and the whole cache.
        ``is_causal=True`` would align the diagonal top-left within the call (a decode step's one query
        would see key 0 only), so a call with fewer rows than keys gets the bottom-right mask explicitly
        (:meth:`_masks` of the call's view: the causal band AND the window AND the mask, the bias and ALiBi
        as a float mask).  Per call: q_proj (q_rot), the cache's k_proj (k_rot) and v_proj, head_outputs,
        concat, output."""
        module = self._module(case)

        def step(view: Case, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: backend.KVCache,
                 q_start: int) -> dict[str, torch.Tensor]:
            return module(query=query, key=key, value=value, cache=cache, q_start=q_start, **self._masks(view))

        return backend.decode(case, self.device, step)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``torch.autograd`` through SDPA's own backward: the projections'
        and the head outputs' gradients through ``retain_grad`` (SDPA exposes no d_scores, d_attn_weights),
        d_sink_logits from the ``sink_logits`` parameter (the extra key column's mask entry), and with a
        bias input d_bias: the float ``attn_mask`` passed as a leaf that requires grad
        (``attn_mask=mask.requires_grad_()``), its gradient summed to the bias input's shape."""
        module, masks = self._module(case), self._masks(case)
        bias = masks["attn_mask"].requires_grad_() if case.inputs.bias is not None else None  # (B|1, H|1, T, S)
        return backend.autograd_backward(case, self.device, self._call(module, masks), module, state_dict_to_canonical,
                                         bias=bias)
