"""The backward pass: the upstream gradient ``d_output`` and the backward stages
(the contract is written up in docs/backward.md).

The loss is ``L = Σ d_output ⊙ output``, so every stage ``d_X`` is ∂L/∂X.
Stages in reverse pipeline order, then the gradients a framework gives the
user (inputs, then weights, then biases)::

    d_concat        (B, T, H·E)       d_output @ w_oᵀ
    d_head_outputs  (B, H, T, E)      d_concat split into heads
    d_attn_weights  (B, H, T, S)      d_head_outputs @ V_g(h)ᵀ          (masked entries: not compared)
    d_scores        (B, H, T, S)      P ⊙ (d_attn_weights − Σ_S P ⊙ d_attn_weights)   (masked: exactly 0)
    d_sink_logits   (H,)              −Σ_{B,T} p_sink ⊙ Σ_S P ⊙ d_attn_weights        (with sinks)
    d_bias          (B|1, H|1, T, S)  d_scores summed over the axes the bias broadcasts  (with a bias input)
    d_q_rot         (B, T, H·D)       scale · (d_scores ⊙ softcap′) @ K_rot, heads merged   (with RoPE)
    d_k_rot         (B, S, G·D)       scale · Σ_group (d_scores ⊙ softcap′)ᵀ @ Q_rot     (with RoPE)
    d_q_proj        (B, T, H·D)       scale · d_scores @ K_g(h), heads merged  (RoPE: d_q_rot turned back)
    d_k_proj        (B, S, G·D)       scale · Σ_{h in group g} d_scoresᵀ @ Q_h  (RoPE: d_k_rot turned back)
    d_v_proj        (B, S, G·E)       Σ_{h in group g} attn_weightsᵀ @ d_head_outputs
    d_query         (B, T, d_model)   d_q_proj @ w_qᵀ   (self-attention: + d_k_proj @ w_kᵀ + d_v_proj @ w_vᵀ)
    d_key           (B, S, kdim)      d_k_proj @ w_kᵀ   (absent in self-attention cases)
    d_value         (B, S, vdim)      d_v_proj @ w_vᵀ   (absent in self-attention cases)
    d_w_q … d_w_o   weight shapes     xᵀ @ d_y summed over B and L
    d_b_q … d_b_o   bias shapes       d_y summed over B and L  (absent without bias)

Self-attention (``inputs="self"``): query, key and value are one tensor, so the
gradient a framework gives is the sum of the three input gradients; the spec
calls that sum ``d_query`` and has no ``d_key``/``d_value`` for such a case.
Likewise ``inputs="shared_kv"`` (key = value, one memory tensor): ``d_key`` is
the sum of the key and value gradients and there is no ``d_value``.
"""

from __future__ import annotations

import numpy as np

from .config import MHAConfig
from .data import dyadic_tensor
from .stages import BACKWARD_STAGES, INPUT_GRADIENT_STAGES, REGISTRY, gradient_of, has_stage

#: For each kind of case inputs (``CaseSpec.inputs``): the tensors a case passes, each as the
#: inputs it is passed as (docs/spec.md: one tensor passed as several inputs).
PASSED_AS: dict[str, tuple[tuple[str, ...], ...]] = {
    "distinct": (("query",), ("key",), ("value",)),
    "shared_kv": (("query",), ("key", "value")),
    "self": (("query", "key", "value"),),
}

#: For each kind of case inputs: the input gradients it has — one per tensor passed, named after
#: the first input it is passed as — and the projections (q, k, v) whose gradients each one sums
#: (one tensor passed twice gets the sum).
INPUT_GRADIENTS: dict[str, dict[str, str]] = {
    kind: {gradient_of(names[0]): "".join(n[0] for n in names) for names in tensors}
    for kind, tensors in PASSED_AS.items()
}

#: Input gradients that self-attention folds into the query's gradient.
FOLDED_IN_SELF_ATTENTION: tuple[str, ...] = tuple(n for n in INPUT_GRADIENT_STAGES if n not in INPUT_GRADIENTS["self"])

#: ``d_output`` is ``k · 2^-D_OUTPUT_EXPONENT`` with |k| <= 64, like the inputs: exact in every dtype.
D_OUTPUT_EXPONENT = 5


def make_d_output(seed: int, batch: int, tgt_len: int, config: MHAConfig) -> np.ndarray:
    """The upstream gradient of a case: (B, T, d_out), dyadic, from SHAKE-256 of ``"<seed>/d_output"``."""
    return dyadic_tensor(f"{seed}/d_output", (batch, tgt_len, config.d_out), D_OUTPUT_EXPONENT)


def backward_stage_shapes(
    config: MHAConfig, batch: int, tgt_len: int, src_len: int, inputs: str = "distinct",
    bias_shape: tuple[int, ...] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Canonical shape of every backward stage a case has, in :data:`BACKWARD_STAGES` order.

    ``inputs`` is the case's kind of inputs (``"distinct"``, ``"shared_kv"``, ``"self"``);
    ``bias_shape`` the shape of its additive ``bias`` input (B|1, H|1, T, S), None without one.
    Without bias there are no ``d_b_*``; a tensor passed as several inputs has one
    gradient (:data:`INPUT_GRADIENTS`): self-attention has no ``d_key``/``d_value``,
    shared key/value no ``d_value``.  The variants' gradients are there with their variant
    (:func:`~mhaspec.spec.stages.has_stage`): ``d_q_rot``/``d_k_rot`` with RoPE,
    ``d_sink_logits`` with sinks, ``d_bias`` (the ``bias`` input's shape) with a ``bias`` input.
    """
    inputs_have = INPUT_GRADIENTS[inputs]
    present = [name for name in BACKWARD_STAGES
               if (REGISTRY[name].only_with is None or config.bias)
               and (REGISTRY[name].gradient_of is None or name in inputs_have)
               and has_stage(name, config, bias_shape is not None)]
    input_shapes = {"bias": bias_shape}
    return {name: (input_shapes[REGISTRY[name].like_input]  # type: ignore[misc]
                   if REGISTRY[name].like_input else REGISTRY[name].shape(config, batch, tgt_len, src_len))
            for name in present}
