"""MHA written with plain TensorFlow ops, returning every stage (built-in name ``tensorflow``).

What a user porting the row-vector MHA layer to TensorFlow writes: a
``tf.Module`` holding the four projections as variables in the canonical
layout (``y = x @ W + b``; head h owns columns ``[h·D, (h+1)·D)``, so the
weight converters are reshape-free), ``tf.linalg.matmul`` for the projections,
``tf.einsum`` for the per-head products and ``tf.nn.softmax``.  TensorFlow
computes every op in the dtype under test (float64, float32, float16 and
bfloat16 all have CPU kernels).

Dataflow (axis legend as in :mod:`mhaspec.spec.config`)::

    query (B,T,d) ─ @W_q+b_q ─► q (B,T,H·D) ─► Q (B,T,H,D) ─┐
    key   (B,S,k) ─ @W_k+b_k ─► k (B,S,G·D) ─► K (B,S,G,D) ─┤ repeat G→H
    value (B,S,v) ─ @W_v+b_v ─► v (B,S,G·E) ─► V (B,S,G,E) ─┤
        scores = scale·Q Kᵀ (B,H,T,S) ─► masked softmax ─► P (B,H,T,S)
        O = P V (B,H,T,E) ─► concat (B,T,H·E) ─ @W_o+b_o ─► output (B,T,d_out)

Masking: causal AND mask; masked scores are replaced by the dtype's lowest
finite value before ``tf.nn.softmax`` and masked probabilities are set to 0
after it, so a query row that sees no key gets all-zero weights (the spec)
rather than the uniform row a softmax alone gives.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..protocol.contract import Deviation
from ..spec import Case, MHAConfig, Weights, masks
from .backends.tensorflow import (TF_DISTRIBUTION, array_in, array_out, distinct_inputs, einsum_deviations,
                                  keep_mask, probe, softmax_deviations, tf)
from .backends.tensorflow import dtype as _dtype


class TFMultiHeadAttention(tf.Module):
    """Multi-head attention in plain TensorFlow ops.

    Variables ``w_q (d_model, H·D_k)``, ``w_k (kdim, H_kv·D_k)``,
    ``w_v (vdim, H_kv·D_v)``, ``w_o (H·D_v, d_out)`` and, with bias,
    ``b_q, b_k, b_v, b_o`` — exactly the canonical layout.
    """

    def __init__(self, config: MHAConfig, dtype: str = "float32", name: str | None = None) -> None:
        super().__init__(name=name)
        self.config = config
        self.dtype = _dtype(dtype)
        self.params = {
            n: tf.Variable(tf.zeros(shape, dtype=self.dtype), name=n, trainable=True)
            for n, shape in config.weight_shapes().items()
        }

    def __call__(self, query, key, value, mask=None) -> dict[str, tf.Tensor]:
        """Every stage for ``query (B,T,d_model)``, ``key (B,S,kdim)``, ``value (B,S,vdim)``;
        ``mask``: bool broadcastable to (B, H, T, S), True = may attend."""
        cfg, p = self.config, self.params
        H, G, D, E = cfg.H, cfg.H_kv, cfg.D_k, cfg.D_v
        B, T, S = tf.shape(query)[0], tf.shape(query)[1], tf.shape(key)[1]

        def linear(x, w, b):  # (B, L, in) @ (in, out) + (out,)
            y = tf.linalg.matmul(x, w)
            return y if b is None else y + b

        q = linear(query, p["w_q"], p.get("b_q"))  # (B, T, H·D)
        k = linear(key, p["w_k"], p.get("b_k"))  # (B, S, G·D)
        v = linear(value, p["w_v"], p.get("b_v"))  # (B, S, G·E)

        Q = tf.reshape(q, (B, T, H, D))
        K = tf.repeat(tf.reshape(k, (B, S, G, D)), H // G, axis=2)  # head h reads kv head h // (H/G)
        V = tf.repeat(tf.reshape(v, (B, S, G, E)), H // G, axis=2)

        scores = tf.einsum("BTHD,BSHD->BHTS", Q, K) * tf.constant(cfg.scale, dtype=self.dtype)

        allowed = tf.ones((1, 1, T, S), dtype=tf.bool)
        shift = masks.causal_offset(cfg, T, S)
        if shift is not None:
            allowed = tf.range(S)[None, :] <= tf.range(T)[:, None] + shift  # (T, S): the causal band
        if mask is not None:
            allowed = tf.logical_and(allowed, mask)
        logits = tf.where(allowed, scores, self.dtype.min)
        weights = tf.where(allowed, tf.nn.softmax(logits, axis=-1), tf.zeros((), self.dtype))  # (B,H,T,S)

        heads = tf.einsum("BHTS,BSHE->BHTE", weights, V)
        concat = tf.reshape(tf.transpose(heads, (0, 2, 1, 3)), (B, T, H * E))
        output = linear(concat, p["w_o"], p.get("b_o"))
        return {
            "q_proj": q, "k_proj": k, "v_proj": v, "scores": scores, "attn_weights": weights,
            "head_outputs": heads, "concat": concat, "output": output,
        }


def load_canonical(module: TFMultiHeadAttention, weights: Weights | Mapping[str, np.ndarray]) -> None:
    """Assign canonical weights (a ``Weights`` or ``{"w_q": …}``, float64) to the module, cast to its dtype."""
    if isinstance(weights, Weights):
        weights = weights.as_dict()
    if set(module.params) != set(weights):
        raise ValueError(f"weights: expected {sorted(module.params)}, got {sorted(weights)}")
    for name, var in module.params.items():
        value = np.asarray(weights[name])
        if value.shape != tuple(var.shape):
            raise ValueError(f"weights.{name}: expected shape {tuple(var.shape)}, got {value.shape}")
        var.assign(value.astype(module.dtype.as_numpy_dtype))


def canonical_weights(module: TFMultiHeadAttention) -> dict[str, np.ndarray]:
    """The module's weights as canonical float64 arrays (the inverse of :func:`load_canonical`)."""
    return {name: array_out(var).astype(np.float64) for name, var in module.params.items()}


class TensorFlowMHAAdapter:
    """The plain-TensorFlow adapter (built-in name ``tensorflow``)."""

    name = "tensorflow"
    framework = TF_DISTRIBUTION  # "tensorflow" or "tensorflow-cpu"

    @property
    def known_deviations(self) -> list[Deviation]:
        """What this process's TensorFlow measures (``backends.tensorflow.probe()``, run once, here: the worker
        reads this after loading the adapter): oneDNN's softmax flush where the softmax flushes, the
        einsum stages in each narrow dtype whose einsum sums in the dtype, and float16's Sum."""
        measured = probe()
        return [*softmax_deviations(measured), *einsum_deviations(measured)]

    def run(self, case: Case) -> dict[str, np.ndarray]:
        module = TFMultiHeadAttention(case.config, case.dtype)
        load_canonical(module, case.weights)
        query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
        stages = module(query=query, key=key, value=value, mask=keep_mask(case))
        return {name: array_out(t) for name, t in stages.items()}

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``tf.GradientTape``: the gradients of Σ d_output ⊙ output with
        respect to each intermediate stage tensor the module computed under the tape, the inputs
        and the variables (canonical layout already: no converter).

        One tensor per input: self-attention passes the query tensor as key and value (its
        gradient, ``d_query``, is the sum of the three), shared key/value one memory tensor
        (``d_key``, the sum of two), as docs/backward.md says."""
        module = TFMultiHeadAttention(case.config, case.dtype)
        load_canonical(module, case.weights)
        query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
        inputs = distinct_inputs(case, query, key, value)
        with tf.GradientTape() as tape:
            tape.watch(list(inputs.values()))
            stages = module(query=query, key=key, value=value, mask=keep_mask(case))
        sources = {f"d_{name}": t for name, t in stages.items() if name != "output"}
        sources.update(inputs)
        sources.update({f"d_{name}": var for name, var in module.params.items()})
        grads = tape.gradient(stages["output"], sources, output_gradients=array_in(case.d_output, case.dtype))
        return {name: array_out(g) for name, g in grads.items()}
