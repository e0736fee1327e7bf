"""The Flax layer of the JAX backend: the parameter layout of both Flax attention layers, the
canonical weights converted to it and back (``weights_in``, ``weights_out``), what the layers
cannot express, and their per-head stages brought to the canonical shapes.

Flax layout (``flax.linen.MultiHeadDotProductAttention`` params and
``flax.nnx.MultiHeadAttention`` state share it)::

    query.kernel (d_model, H, D)     query.bias (H, D)       <- w_q (d_model, H·D), b_q (H·D,)
    key.kernel   (kdim, H_kv, D)     key.bias   (H_kv, D)    <- w_k (kdim, H_kv·D), b_k
    value.kernel (vdim, H_kv, E)     value.bias (H_kv, E)    <- w_v (vdim, H_kv·E), b_v
    out.kernel   (H, E, d_out)       out.bias   (d_out,)     <- w_o (H·E, d_out), b_o

The canonical head h owns columns [h·D, (h+1)·D), so every conversion is a
row-major reshape: no transpose, no copy of values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ...spec import MHAConfig

#: Where a Flax layer's bfloat16 bias gradients (the transpose of a bfloat16 broadcast, summed in bfloat16)
#: exceed the standard contract in the catalog: (case, stage) patterns of ``flax.bias-grad-bfloat16``.
BIAS_GRAD_BF16_WHERE = (("long_sequence", "d_b_o"), ("tile_crossing", "d_b_o"))


def layer_limits(config: MHAConfig, layer: str) -> str | None:
    """Why Flax's attention ``layer`` cannot express ``config``, or None.

    Both Flax layers use one head size (qkv_features // num_heads) for query,
    key and value, and always scale by 1/sqrt(head_dim).
    """
    if config.D_v != config.D_k:
        return (f"{layer} uses one head size (qkv_features // num_heads) for query, key and value: "
                f"D_v={config.D_v} != D_k={config.D_k}")
    if not math.isclose(config.scale, 1 / math.sqrt(config.D_k), rel_tol=1e-12):
        return (f"{layer} has no scale argument (it always divides the query by sqrt(head_dim)): "
                f"scale={config.scale} != 1/sqrt({config.D_k})")
    return None


def causal_band(T: int, S: int, offset: int | None) -> jax.Array | None:
    """(1, 1, T, S) bool in jnp (inside a trace: T, S static), True where query i may see key j:
    j <= i + ``offset`` (``mhaspec.spec.masks.causal_offset``), by Flax's ``make_attention_mask``
    (linen's and nnx's are the same code); None for no offset (not causal)."""
    if offset is None:
        return None
    return nn.make_attention_mask(
        query_input=jnp.arange(T)[None] + offset, key_input=jnp.arange(S)[None],
        pairwise_fn=jnp.greater_equal, dtype=jnp.bool_,
    )


def _as_dict(weights: Any) -> dict[str, np.ndarray]:
    if hasattr(weights, "as_dict"):
        weights = weights.as_dict()
    return {k: np.asarray(v) for k, v in dict(weights).items() if v is not None}


def weights_in(weights: Any, config: MHAConfig) -> dict[str, dict[str, np.ndarray]]:
    """Canonical weights -> ``{"query"|"key"|"value"|"out": {"kernel", "bias"}}`` (see module doc).

    ``weights`` is a :class:`~mhaspec.spec.Weights` or a mapping ``w_q … b_o``;
    biases are left out when absent (``use_bias=False``).
    """
    w = _as_dict(weights)
    H, G, D, E = config.H, config.H_kv, config.D_k, config.D_v
    heads = {"query": ("q", H, D), "key": ("k", G, D), "value": ("v", G, E)}
    tree: dict[str, dict[str, np.ndarray]] = {}
    for name, (x, n, size) in heads.items():
        tree[name] = {"kernel": w[f"w_{x}"].reshape(-1, n, size)}  # (in, heads, size)
        if f"b_{x}" in w:
            tree[name]["bias"] = w[f"b_{x}"].reshape(n, size)  # (heads, size)
    tree["out"] = {"kernel": w["w_o"].reshape(H, E, -1)}  # (H, E, d_out)
    if "b_o" in w:
        tree["out"]["bias"] = w["b_o"]  # (d_out,)
    return tree


def weights_out(tree: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The inverse of :func:`weights_in`: canonical ``w_q … b_o`` (biases only if present)."""
    out: dict[str, np.ndarray] = {}
    for name, x in (("query", "q"), ("key", "k"), ("value", "v")):
        kernel = np.asarray(tree[name]["kernel"])  # (in, heads, size)
        out[f"w_{x}"] = kernel.reshape(kernel.shape[0], -1)
        if "bias" in tree[name]:
            out[f"b_{x}"] = np.asarray(tree[name]["bias"]).reshape(-1)
    kernel = np.asarray(tree["out"]["kernel"])  # (H, E, d_out)
    out["w_o"] = kernel.reshape(-1, kernel.shape[-1])
    if "bias" in tree["out"]:
        out["b_o"] = np.asarray(tree["out"]["bias"])
    return out


def merged_heads(stages: dict[str, Any], batch: int, tgt_len: int, prefix: str = "") -> dict[str, Any]:
    """A Flax layer's per-head stages (numpy) in the canonical layout, in place: the projections'
    (B, L, heads, D) flattened to (B, L, heads·D); W^O's input (B, T, H, D) as ``head_outputs``
    (B, H, T, D) and ``concat`` (B, T, H·D).  ``prefix="d_"``: the same for their gradients."""
    for name in ("q_proj", "k_proj", "v_proj"):
        g = stages[prefix + name]
        stages[prefix + name] = g.reshape(*g.shape[:2], -1)
    heads = stages.pop(prefix + "head_outputs")  # (B, T, H, D)
    stages[prefix + "head_outputs"], stages[prefix + "concat"] = heads.transpose(0, 2, 1, 3), heads.reshape(
        batch, tgt_len, -1)
    return stages
