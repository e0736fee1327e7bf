"""``flax.linen.MultiHeadDotProductAttention`` with the case's weights in its params tree.

Params layout (DenseGeneral kernels keep the heads as their own axis)::

    query/kernel (d_model, H, D)   key/kernel (kdim, H, D)   value/kernel (vdim, H, D)   out/kernel (H, D, d_out)
    query/bias   (H, D)            key/bias   (H, D)         value/bias   (H, D)         out/bias   (d_out,)

What the layer exposes, and how it is read:

- q_proj, k_proj, v_proj: the outputs of its ``query``/``key``/``value``
  DenseGeneral submodules, from ``capture_intermediates=True``;
- attn_weights: ``sow_weights=True`` (the ``intermediates`` collection);
- head_outputs, concat: the (B, T, H, D) array the layer hands to its ``out``
  DenseGeneral, read with ``nn.intercept_methods``;
- scores: not exposed (the layer folds 1/sqrt(D) into the query first).

The layer has no causal flag, no scale argument (it always divides the query
by sqrt(head_dim)), one head size for query, key and value, and as many
key/value heads as query heads.  Causal masking is a boolean mask made with
``nn.make_attention_mask`` (query position + shift >= key position: shift 0
is top-left, S - T bottom-right; ``nn.make_causal_mask`` is top-left and
square only) and ANDed with the case's mask by ``nn.combine_masks``.  Mask
polarity is the spec's: True = may attend.  Different kdim and vdim work: the
key and value inputs are separate and DenseGeneral takes its input size from
the kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..spec import Case, MHAConfig, masks
from .backends.flax import BIAS_GRAD_BF16_WHERE, causal_band, layer_limits, merged_heads, weights_in, weights_out
from .backends.jax import (FULLY_MASKED_BACKWARD, CompilingAdapter, array_out, compiled, computing_in, declared_at,
                           declared_where, keep_mask, tree_in, vjp_stages)
from .backends.jax import array_in as _array_in
from .backends.jax import dtype as _dtype


def canonical_to_linen_params(weights: Any, config: MHAConfig) -> dict[str, dict[str, np.ndarray]]:
    """Canonical weights (``Weights`` or a ``w_q … b_o`` mapping) -> the layer's ``params`` tree.

    Use it as ``layer.apply({"params": canonical_to_linen_params(w, cfg)}, …)``; float64
    numpy arrays, cast them to the layer's ``param_dtype`` as needed.
    """
    return weights_in(weights, config)


def linen_params_to_canonical(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The layer's ``params`` tree (or ``{"params": tree}``) -> canonical ``w_q … b_o``."""
    if "params" in params:
        params = params["params"]
    return weights_out(params)


def linen_layer(cfg: MHAConfig, dtype: str) -> nn.MultiHeadDotProductAttention:
    """The layer for ``cfg`` in ``dtype`` (its params: :func:`canonical_to_linen_params`).

    Its initializers are ``zeros``: every parameter is the case's, so none is ever initialised,
    but ``apply`` still traces each parameter's initializer (``jax.eval_shape``) to check the
    given shape (``flax.core.scope.Scope.param``), in every case's trace, forward and backward.
    The default ``lecun_normal`` traces a random draw, ``zeros`` one broadcast: a warm
    ``mhaspec run flax-linen --backward`` takes ~2 s (a tenth) less CPU time.  The stages are
    the same bit for bit: the initializers are not in the computation (tests/frameworks/test_jax.py).
    """
    return nn.MultiHeadDotProductAttention(
        num_heads=cfg.H, qkv_features=cfg.H * cfg.D_k, out_features=cfg.d_out, use_bias=cfg.bias,
        dtype=_dtype(dtype), param_dtype=_dtype(dtype), deterministic=True,
        kernel_init=nn.initializers.zeros, bias_init=nn.initializers.zeros,
    )


def causal_mask(case: Case) -> jax.Array | None:
    """(1, 1, T, S) bool, True where query i may see key j (j <= i + the case's causal offset), or None
    if not causal."""
    return causal_band(case.tgt_len, case.src_len, masks.causal_offset(case.config, case.tgt_len, case.src_len))


def apply(layer: nn.Module, params: dict, query: jax.Array, key: jax.Array, value: jax.Array,
          mask: jax.Array | None, causal_shift: int | None = None) -> dict[str, jax.Array]:
    """Call the layer once; return its output and what it exposes on the way (jit-compiled,
    ``layer`` and ``causal_shift`` static).  ``mask``: the case's (True = may attend), ANDed here
    by ``nn.combine_masks`` with the causal band of ``causal_shift`` (the case's
    ``mhaspec.spec.masks.causal_offset``; :func:`~.backends.flax.causal_band`)."""
    mask = nn.combine_masks(mask, causal_band(query.shape[1], key.shape[1], causal_shift), dtype=jnp.bool_)
    out_inputs = []

    def read_out_input(next_fun, args, kwargs, context):  # the (B, T, H, D) array fed to W^O
        if context.module.name == "out" and context.method_name == "__call__":
            out_inputs.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(read_out_input):
        y, state = layer.apply(
            {"params": params}, inputs_q=query, inputs_k=key, inputs_v=value, mask=mask,
            sow_weights=True, capture_intermediates=True, mutable=["intermediates"],
        )
    inter = state["intermediates"]
    return {
        "q_proj": inter["query"]["__call__"][0],  # (B, T, H, D): the heads merged by the caller (numpy)
        "k_proj": inter["key"]["__call__"][0],
        "v_proj": inter["value"]["__call__"][0],
        "attn_weights": inter["attention_weights"][0],
        "head_outputs": out_inputs[0],  # (B, T, H, D)
        "output": y,
    }


class FlaxLinenAdapter(CompilingAdapter):
    """The ``flax-linen`` adapter: ``flax.linen.MultiHeadDotProductAttention``."""

    name = "flax-linen"
    framework = "flax"
    known_deviations = [
        *declared_at("flax-linen.fully-masked", ("attn_weights", "head_outputs", "concat", "output")),
        *declared_at("flax-linen.fully-masked-backward", FULLY_MASKED_BACKWARD),
        *declared_where("flax.bias-grad-bfloat16", (("cross_attention", "d_b_v"), *BIAS_GRAD_BF16_WHERE)),
    ]

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.H_kv != cfg.H:
            return (f"MultiHeadDotProductAttention has as many key/value heads as query heads "
                    f"(no num_kv_heads): H_kv={cfg.H_kv} != H={cfg.H}")
        return layer_limits(cfg, "MultiHeadDotProductAttention") or True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            params = tree_in(canonical_to_linen_params(case.weights, cfg), dtype)
            stages = array_out(compiled(apply, ("layer", "causal_shift"), self.fast)(
                linen_layer(cfg, dtype), params, *case.inputs_as(lambda x: _array_in(x, dtype)), keep_mask(case),
                causal_shift=masks.causal_offset(cfg, case.tgt_len, case.src_len),
            ))
        return merged_heads(stages, case.batch, case.tgt_len)  # in numpy: reshapes cost no compilation

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``jax.vjp`` of the layer's ``apply`` with respect to the inputs and
        its ``params`` tree, whose gradient goes back through :func:`linen_params_to_canonical`.

        Intermediate stages through zero taps that ``nn.intercept_methods`` adds where :meth:`run`
        reads the stages: the ``query``/``key``/``value`` DenseGeneral outputs (``d_q_proj`` …) and
        the (B, T, H, D) input of ``out`` (``d_head_outputs``, ``d_concat``).  The attention weights
        are made inside ``attention_fn``, where no tap reaches: no ``d_scores``, ``d_attn_weights``."""
        cfg, dtype = case.config, case.dtype
        B, T, S, H, D = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.D_k
        with computing_in(dtype, self.device):
            layer = linen_layer(cfg, dtype)
            params = tree_in(canonical_to_linen_params(case.weights, cfg), dtype)
            mask = None if case.inputs.mask is None else jnp.asarray(case.inputs.mask)
            mask = nn.combine_masks(mask, causal_mask(case), dtype=jnp.bool_)
            tapped = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}

            def output(query, key, value, params, taps):
                def tap(next_fun, args, kwargs, context):
                    name = context.module.name if context.method_name == "__call__" else None
                    if name == "out":  # its input is the head outputs (B, T, H, D)
                        return next_fun(args[0] + taps["head_outputs"], *args[1:], **kwargs)
                    y = next_fun(*args, **kwargs)
                    return y + taps[tapped[name]] if name in tapped else y

                with nn.intercept_methods(tap):
                    return layer.apply({"params": params}, inputs_q=query, inputs_k=key, inputs_v=value, mask=mask)

            shapes = {"q_proj": (B, T, H, D), "k_proj": (B, S, H, D), "v_proj": (B, S, H, D),
                      "head_outputs": (B, T, H, D)}
            grads = vjp_stages(case, output, shapes, weights=params, to_canonical=linen_params_to_canonical,
                               fast_compile=self.fast)
        return merged_heads(grads, B, T, prefix="d_")
