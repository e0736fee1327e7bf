"""``keras.ops.dot_product_attention`` between ``keras.ops`` projections, on the TensorFlow backend
(built-in name ``keras-dpa``).

What a Keras 3 user writes around the functional attention op: the four
projections with canonical weights (``keras.ops.matmul(x, W) + b``), the
heads as (B, L, heads, D) (the op's BTNH layout), RoPE on Q and K, then

    keras.ops.dot_product_attention(query, key, value, bias=…, mask=…, scale=…, is_causal=…)

and W^O.  The variants (docs/spec.md §2a) it computes:

* **window**: the op has no window argument: the band goes into its boolean ``mask``;
* **bias** and **alibi**: its ``bias`` argument (broadcast to (B, N, T, S), added to the scaled
  logits), the case's bias input plus −slope·|i + off − j|; the op converts ``bias`` to the
  compute dtype first;
* **rope**: on the projections before the call, in ``keras.ops`` (cos and sin in float32, float64
  in a float64 run, cast to the dtype).

Not the softcap: the op's ``attn_logits_soft_cap`` raises ValueError on every backend but JAX on a
TPU ("only supported for JAX on TPU", keras/src/ops/nn.py), and the TensorFlow backend's op never
reads it.  No sinks, no log-sum-exp (the op returns only its output).  Its ``is_causal`` is
top-left (``tf.linalg.band_part``), so bottom-right alignment goes into the mask.

    query ─ matmul ─ q_proj ─ RoPE ─ (B,T,H,D) ─┐
    key   ─ matmul ─ k_proj ─ RoPE ─ (B,S,G,D) ─┼─ keras.ops.dot_product_attention ─ (B,T,H,E) ─ concat ─ matmul ─ output
    value ─ matmul ─ v_proj ──────── (B,S,G,E) ─┘
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..protocol.contract import Deviation
from ..spec import CATALOG, Case
from ..spec.variant_ops import alibi
from .backends import declared, variants
from .backends.tensorflow import array_in, array_out, declared_at, distinct_inputs, keep_mask, quiet_import, tf
from .keras_mha import _SCALE_INEXACT_IN_FLOAT32, _deviations

keras = quiet_import("keras")
ops = keras.ops


def linear(x: Any, w: Any, b: Any | None) -> Any:
    """``x @ w + b`` by ``keras.ops`` (in the dtype).   (B, L, in) @ (in, out) -> (B, L, out)."""
    y = ops.matmul(x, w)
    return y if b is None else ops.add(y, b)


def rope(x: Any, heads: int, offset: int, spec: Any, dtype: str) -> Any:
    """x (B, L, heads·D) turned by RoPE in ``keras.ops`` (:func:`.backends.variants.rope`)."""
    return variants.rope(x, heads, offset, spec, dtype, ops, ops.cast)


def score_bias(case: Case, bias: Any | None) -> Any | None:
    """The op's ``bias``: the case's bias input ``bias`` (B|1, H|1, T, S) in the dtype, plus ALiBi (1, H, T, S),
    taken in float32 (float64 in a float64 run); None when neither.  The op converts it to the compute dtype."""
    at = variants.rope_angles_dtype(case.dtype)  # where a Keras model builds its ALiBi bias: float32 or float64
    total = None if bias is None else ops.cast(bias, at)
    term = alibi(case.config, case.T, case.S, case.T)  # (H, T, S) float64: −slope·|i + off − j|
    if term is not None:
        term = tf.constant(term[None].astype(at))
        total = term if total is None else ops.add(total, term)
    return total


def dpa_mask(case: Case) -> tuple[Any | None, bool]:
    """(boolean mask (B, 1|H, T, S), is_causal) for the op; True = take part, as in the spec.  Top-left
    causal uses its ``is_causal``; bottom-right and the window go into the mask."""
    cfg = case.config
    top_left = cfg.causal_alignment == "top_left"
    has_window = cfg.window_left is not None or cfg.window_right is not None
    return keep_mask(case, causal=not top_left, window=has_window), cfg.causal and top_left


def stages_of(case: Case, query: Any, key: Any, value: Any, weights: Mapping[str, Any],
              watch: Callable[[str, Any], Any] = lambda name, t: t) -> dict[str, Any]:
    """Every stage the layer computes, as tensors: q_proj, k_proj, v_proj, q_rot and k_rot with RoPE,
    head_outputs (B, H, T, E), concat, output.  ``watch(name, t)`` is called on each tensor whose gradient
    the backward takes (its tape watches them): the intermediate stages, the bias input (``"bias"``, in the
    dtype) and the op's output (``"head_outputs"``, in its BTNH layout)."""
    cfg, dtype, w = case.config, case.dtype, weights
    B, T, S = case.B, case.T, case.S
    out = {"q_proj": watch("q_proj", linear(query, w["w_q"], w.get("b_q"))),  # (B, T, H·D)
           "k_proj": watch("k_proj", linear(key, w["w_k"], w.get("b_k"))),  # (B, S, G·D)
           "v_proj": watch("v_proj", linear(value, w["w_v"], w.get("b_v")))}  # (B, S, G·E)
    q, k = out["q_proj"], out["k_proj"]
    if cfg.rope is not None:
        q = out["q_rot"] = watch("q_rot", rope(q, cfg.H, cfg.rope.query_offset, cfg.rope, dtype))
        k = out["k_rot"] = watch("k_rot", rope(k, cfg.H_kv, cfg.rope.key_offset, cfg.rope, dtype))
    bias = None if case.inputs.bias is None else watch("bias", array_in(case.inputs.bias, dtype))
    mask, is_causal = dpa_mask(case)
    encoded = ops.dot_product_attention(
        query=ops.reshape(q, (B, T, cfg.H, cfg.D_k)), key=ops.reshape(k, (B, S, cfg.H_kv, cfg.D_k)),
        value=ops.reshape(out["v_proj"], (B, S, cfg.H_kv, cfg.D_v)), bias=score_bias(case, bias), mask=mask,
        scale=cfg.scale, is_causal=is_causal,
    )  # BTNH
    encoded = watch("head_outputs", encoded)
    out["head_outputs"] = ops.transpose(encoded, (0, 2, 1, 3))  # (B, H, T, E)
    out["concat"] = watch("concat", ops.reshape(encoded, (B, T, cfg.H * cfg.D_v)))
    out["output"] = linear(out["concat"], w["w_o"], w.get("b_o"))
    return out


def scale_in_float32_variants() -> list[Deviation]:
    """``keras.scale-in-float32`` carried into the variants' gradients, one declaration per catalog case whose
    1/√D_k is not a float32 number, naming those it has: ``d_bias`` with a bias input, ``d_q_rot`` and
    ``d_k_rot`` with RoPE, and then ``d_b_k`` (with RoPE the key bias turns with the position, so its gradient
    is no longer ~0 and carries the scale's rounding as d_k_proj does)."""
    out = []
    for spec in CATALOG:
        cfg = spec.config
        stages = (["d_bias"] if spec.bias is not None else []) + (["d_[qk]_rot"] if cfg.rope is not None else []) \
            + (["d_b_k"] if cfg.rope is not None and cfg.bias else [])
        if spec.id in _SCALE_INEXACT_IN_FLOAT32 and stages:
            out += declared_at("keras.scale-in-float32", ("|".join(stages),), case=spec.id)
    return out


class KerasDPAAdapter:
    """``keras.ops.dot_product_attention`` between ``keras.ops`` projections (TensorFlow backend)."""

    name = "keras-dpa"
    framework = "keras"
    variants = frozenset({"window", "bias", "alibi", "rope"})
    #: those of the layers' fused path, which is this op, and BiasAddGrad's bfloat16 sums of every bias
    known_deviations = [*_deviations(("head_outputs", "concat", "output"), fully_masked=True, bias_add=False),
                        *scale_in_float32_variants(),
                        *declared("tensorflow", "keras-dpa.bias-add-grad-bfloat16")]

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if keras.backend.backend() != "tensorflow":
            return f"Keras runs on the {keras.backend.backend()} backend here; keras-dpa tests the TensorFlow backend"
        if cfg.H_kv == 1 and cfg.H > 1:
            return (f"keras.ops.dot_product_attention on the TensorFlow backend repeats the key/value heads only when "
                    f"num_kv_heads > 1 (keras/src/backend/tensorflow/nn.py), so with one key/value head (MQA, H={cfg.H}) "
                    f"its einsum fails (InvalidArgumentError: Expected dimension {cfg.H} at axis 2)")
        return True

    def _tensors(self, case: Case) -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
        weights = {name: tf.Variable(array_in(w, case.dtype), name=name) for name, w in case.weights.as_dict().items()}
        return case.inputs_as(lambda x: array_in(x, case.dtype)), weights

    def run(self, case: Case) -> dict[str, np.ndarray]:
        (query, key, value), weights = self._tensors(case)
        return {name: array_out(t) for name, t in stages_of(case, query, key, value, weights).items()}

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``tf.GradientTape``: the gradients of Σ d_output ⊙ output with respect
        to the projections, RoPE's rotated Q and K (``d_q_rot``, ``d_k_rot``), the bias input handed to the
        op's ``bias`` (``d_bias``, in its shape), the op's output (``d_head_outputs``, ``d_concat``), the
        inputs and the weights (canonical layout: no converter).  The op exposes no d_scores, d_attn_weights."""
        (query, key, value), weights = self._tensors(case)
        inputs = distinct_inputs(case, query, key, value)
        watched: dict[str, Any] = {}
        with tf.GradientTape() as tape:
            tape.watch(list(inputs.values()))

            def watch(name: str, t: Any) -> Any:
                tape.watch(t)  # the bias input is a constant: watched, or the tape has no gradient for it
                watched[f"d_{name}"] = t
                return t

            stages = stages_of(case, query, key, value, weights, watch=watch)
        sources = {**watched, **inputs, **{f"d_{name}": var for name, var in weights.items()}}
        grads = tape.gradient(stages["output"], sources, output_gradients=array_in(case.d_output, case.dtype))
        out = {name: array_out(g) for name, g in grads.items() if name != "d_sink_logits"}
        out["d_head_outputs"] = out["d_head_outputs"].transpose(0, 2, 1, 3)  # (B, T, H, E) -> (B, H, T, E)
        return out
