"""``flax.nnx.MultiHeadAttention`` with the case's weights loaded into its state.

State layout (LinearGeneral kernels keep the heads as their own axis)::

    query.kernel (d_model, H, D)   key.kernel (kdim, H_kv, D)   value.kernel (kdim, H_kv, D)   out.kernel (H, D, d_out)
    query.bias   (H, D)            key.bias   (H_kv, D)         value.bias   (H_kv, D)         out.bias   (d_out,)

GQA through ``num_kv_heads`` where the installed flax has it (query head h
reads key/value head h // (H / H_kv), as the spec says).  Two call paths:

- ``flax-nnx`` (:class:`FlaxNNXAdapter`): ``sow_weights=True``, flax's own
  einsum/softmax (``dot_product_attention_weights``), which exposes
  attn_weights;
- :class:`FlaxNNXFastAdapter`: ``sow_weights=False``, where flax hands the
  core to ``jax.nn.dot_product_attention`` (the production path).

Both read q_proj, k_proj, v_proj as the outputs of the ``query``/``key``/
``value`` submodules through ``nnx.capture(..., method_outputs=...)``;
scores, head_outputs and concat are not exposed.  Top-left causal uses the
layer's ``is_causal``; bottom-right alignment is a boolean mask from
Flax's ``make_attention_mask`` (query position + S - T >= key position) ANDed
with the case's mask by ``nnx.combine_masks``.  The mask is handed over in
the layer's documented shape (B, 1, T, S): with ``is_causal=True`` and
``sow_weights=True`` a broadcastable (B, 1, 1, S) mask raises (flax
broadcasts the (T, S) causal matrix *to the mask's shape*).  Mask polarity is
the spec's: True = may attend.

No scale argument (always 1/sqrt(head_dim)), one head size for query, key and
value, one ``in_kv_features`` for both key and value: cases needing those are
unsupported.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..spec import Case, MHAConfig, masks
from .backends.flax import BIAS_GRAD_BF16_WHERE, causal_band, layer_limits, merged_heads, weights_in, weights_out
from .backends.jax import (FULLY_MASKED_BACKWARD, THROUGH_SOFTMAX, CompilingAdapter, array_out, compiled,
                           computing_in, declared_at, declared_where, fallback_precision, rejected_algorithm, tree_in,
                           vjp_stages, with_fallback_precision)
from .backends.jax import array_in as _array_in
from .backends.jax import dtype as _dtype

HAS_KV_HEADS = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


def canonical_to_nnx_state(weights: Any, config: MHAConfig) -> dict[str, dict[str, np.ndarray]]:
    """Canonical weights (``Weights`` or a ``w_q … b_o`` mapping) -> the layer's ``nnx.Param`` state as a pure dict.

    Load it with ``state = nnx.state(layer, nnx.Param); nnx.replace_by_pure_dict(state, tree);
    nnx.update(layer, state)`` (float64 numpy arrays: cast them to the layer's ``param_dtype``).
    """
    return weights_in(weights, config)


def nnx_state_to_canonical(state: Any) -> dict[str, np.ndarray]:
    """An ``nnx.MultiHeadAttention``, its ``nnx.State`` or the pure dict -> canonical ``w_q … b_o``."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    if isinstance(state, nnx.State):
        state = nnx.to_pure_dict(state)
    return weights_out(state)


@functools.lru_cache(maxsize=256)
def _abstract_layer(H: int, d_model: int, qkv: int, d_out: int, kdim: int, bias: bool, H_kv: int,
                    dtype: str) -> tuple[Any, Any]:
    """(graphdef, abstract state) of an ``nnx.MultiHeadAttention`` of these sizes in ``dtype``
    (``nnx.eval_shape``: nothing initialised), made once per process: ``nnx.eval_shape`` traces the
    constructor, ~15 ms a layer, and the cases of a catalog share their sizes in each dtype (28
    cases, 16 sizes), run and backward the same layer.  Call inside ``computing_in(dtype)``
    (float64 needs x64 on); :func:`new_layer` merges a copy."""
    kv_heads = {"num_kv_heads": H_kv} if HAS_KV_HEADS else {}
    zeros = nnx.initializers.zeros_init()  # every parameter is replaced: the cheapest initializer to trace
    layer = nnx.eval_shape(lambda: nnx.MultiHeadAttention(
        num_heads=H, in_features=d_model, qkv_features=qkv, out_features=d_out, in_kv_features=kdim,
        use_bias=bias, dtype=_dtype(dtype), param_dtype=_dtype(dtype), decode=False,
        kernel_init=zeros, bias_init=zeros, rngs=nnx.Rngs(0), **kv_heads,
    ))
    return nnx.split(layer)


def new_layer(cfg: MHAConfig, dtype: str) -> nnx.MultiHeadAttention:
    """An abstract ``nnx.MultiHeadAttention`` for ``cfg`` in ``dtype`` (its parameters' shapes and
    dtypes only: load the case's weights with ``nnx.update``), merged from a copy of
    :func:`_abstract_layer`'s state, so that loading weights never reaches the kept one."""
    graphdef, state = _abstract_layer(cfg.H, cfg.d_model, cfg.H * cfg.D_k, cfg.d_out, cfg.kdim, cfg.bias,
                                      cfg.H_kv, dtype)
    return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, state))


def nnx_mask(case: Case) -> tuple[jax.Array | None, bool]:
    """(boolean mask of shape (B, 1, T, S) or None, is_causal); True = may attend."""
    mask = None if case.inputs.mask is None else jnp.asarray(case.inputs.mask)  # (B, 1, 1|T, S)
    return layer_mask(mask, case.batch, case.tgt_len, case.src_len, *causal_flags(case))


def causal_flags(case: Case) -> tuple[int | None, bool]:
    """(the case's causal offset, ``mhaspec.spec.masks.causal_offset``; whether it is top-left aligned)."""
    return masks.causal_offset(case.config, case.tgt_len, case.src_len), case.config.causal_alignment == "top_left"


def layer_mask(mask: jax.Array | None, B: int, T: int, S: int, offset: int | None,
               top_left: bool) -> tuple[jax.Array | None, bool]:
    """:func:`nnx_mask` from the case's mask (B, 1, 1|T, S) or None, its shape and causal flags
    (:func:`causal_flags`; traced inside the compiled forward, so that no eager op compiles for
    each case's shape).  Top-left causal is the layer's ``is_causal``; bottom-right is a band."""
    is_causal = offset is not None and top_left
    if offset is not None and not is_causal:  # bottom-right: key j visible to query i when i + S - T >= j
        mask = nnx.combine_masks(mask, causal_band(T, S, offset), dtype=jnp.bool_)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (B, 1, T, S))
    return mask, is_causal


def forward(layer: nnx.MultiHeadAttention, query: jax.Array, key: jax.Array, value: jax.Array,
            mask: jax.Array | None, is_causal: bool, sow_weights: bool) -> tuple[jax.Array, dict]:
    """Call the layer once; return its output and the captured intermediates (a pure dict)."""
    call = nnx.capture(layer, nnx.Intermediate, method_outputs=nnx.Intermediate)
    y, inter = call(query, key, value, mask=mask, is_causal=is_causal, sow_weights=sow_weights, deterministic=True)
    return y, nnx.to_pure_dict(inter)


def forward_split(graphdef: Any, state: Any, query: jax.Array, key: jax.Array, value: jax.Array,
                  mask: jax.Array | None, is_causal: bool, sow_weights: bool) -> tuple[jax.Array, dict]:
    """:func:`forward` on ``nnx.merge(graphdef, state)``: the functional form ``jax.jit`` compiles
    (``graphdef`` static)."""
    return forward(nnx.merge(graphdef, state), query, key, value, mask, is_causal, sow_weights)


def forward_case(graphdef: Any, state: Any, query: jax.Array, key: jax.Array, value: jax.Array,
                 mask: jax.Array | None, *, offset: int | None, top_left: bool,
                 sow_weights: bool) -> tuple[jax.Array, dict]:
    """:func:`forward_split` with the case's mask made into the layer's (:func:`layer_mask`) inside
    the trace; what :meth:`FlaxNNXAdapter.run` compiles (everything but the arrays static).  In
    float16 on CPU the fast path goes through :func:`~.backends.jax.with_fallback_precision`:
    jax.nn.dot_product_attention asks for the dot algorithm F16_F16_F32, which JAX refuses to lower
    for CPU, and its fallback to the default precision only catches that error outside jit."""
    mask, is_causal = layer_mask(mask, query.shape[0], query.shape[1], key.shape[1], offset, top_left)
    return forward_split(graphdef, state, query, key, value, mask, is_causal, sow_weights)


class FlaxNNXAdapter(CompilingAdapter):
    """The ``flax-nnx`` adapter: ``flax.nnx.MultiHeadAttention`` with ``sow_weights=True``."""

    name = "flax-nnx"
    framework = "flax"
    sow_weights = True
    known_deviations = [
        *declared_at("flax-nnx.fully-masked", ("attn_weights", "output")),
        *declared_at("flax-nnx.fully-masked-backward", FULLY_MASKED_BACKWARD),
        *declared_where("flax.bias-grad-bfloat16", BIAS_GRAD_BF16_WHERE),
    ]

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.H_kv != cfg.H and not HAS_KV_HEADS:
            return f"this flax's nnx.MultiHeadAttention has no num_kv_heads: H_kv={cfg.H_kv} != H={cfg.H}"
        if cfg.kdim != cfg.vdim:
            return (f"nnx.MultiHeadAttention has one in_kv_features for key and value: "
                    f"kdim={cfg.kdim} != vdim={cfg.vdim}")
        return layer_limits(cfg, "nnx.MultiHeadAttention") or True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            layer = new_layer(cfg, dtype)  # abstract: no init to compute
            state = nnx.state(layer, nnx.Param)
            params = canonical_to_nnx_state(case.weights, cfg)
            nnx.replace_by_pure_dict(state, tree_in(params, dtype))
            nnx.update(layer, state)

            inputs = case.inputs_as(lambda x: _array_in(x, dtype))
            fun = forward_case if self.sow_weights else with_fallback_precision(
                forward_case, rejected_algorithm(self.device, dtype))  # the fast path calls dot_product_attention
            jitted = compiled(fun, ("graphdef", "offset", "top_left", "sow_weights"), self.fast)
            graphdef, params = nnx.split(layer)
            offset, top_left = causal_flags(case)
            y, inter = array_out(jitted(graphdef, params, *inputs, _array_in(case.inputs.mask), offset=offset,
                                        top_left=top_left, sow_weights=self.sow_weights))
        B, T, S = case.batch, case.tgt_len, case.src_len  # the heads merged here, in numpy
        stages = {
            "q_proj": inter["query"]["__call__"][0].reshape(B, T, -1),
            "k_proj": inter["key"]["__call__"][0].reshape(B, S, -1),
            "v_proj": inter["value"]["__call__"][0].reshape(B, S, -1),
            "output": y,
        }
        if self.sow_weights:
            stages["attn_weights"] = inter["attention_weights"][0]
        return stages

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``jax.vjp`` of the layer (``nnx.merge`` of its graph and state)
        with respect to the inputs and its ``nnx.Param`` state, whose gradient goes back through
        :func:`nnx_state_to_canonical`.

        Intermediate stages through zero taps: inside the differentiated function the merged
        layer's ``query``/``key``/``value`` submodules are wrapped to add a tap to their outputs
        (``d_q_proj`` …, the key/value heads before any GQA repeat) and ``out`` to add one to its
        (B, T, H, D) input (``d_head_outputs``, ``d_concat``).  The attention weights are made
        inside ``attention_fn``, where no tap reaches: no ``d_scores``, ``d_attn_weights``."""
        cfg, dtype = case.config, case.dtype
        B, T, S, H, G, D = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv, cfg.D_k
        with computing_in(dtype, self.device):
            layer = new_layer(cfg, dtype)
            state = nnx.state(layer, nnx.Param)
            nnx.replace_by_pure_dict(state, tree_in(canonical_to_nnx_state(case.weights, cfg), dtype))
            nnx.update(layer, state)
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
            case_mask = _array_in(case.inputs.mask)  # made the layer's in the trace: no eager op compiles
            offset, top_left = causal_flags(case)

            def output(query, key, value, params, taps):
                mask, is_causal = layer_mask(case_mask, B, T, S, offset, top_left)
                merged = nnx.merge(graphdef, params, rest)
                for sub, stage in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
                    inner = getattr(merged, sub)
                    setattr(merged, sub, lambda x, inner=inner, tap=taps[stage], **kw: inner(x, **kw) + tap)
                out = merged.out
                merged.out = lambda x, **kw: out(x + taps["head_outputs"], **kw)
                call = nnx.capture(merged, nnx.Intermediate)  # where sow_weights=True sows the weights
                y, _ = call(query, key, value, mask=mask, is_causal=is_causal, sow_weights=self.sow_weights,
                            deterministic=True)
                return y

            shapes = {"q_proj": (B, T, H, D), "k_proj": (B, S, G, D), "v_proj": (B, S, G, D),
                      "head_outputs": (B, T, H, D)}
            if not self.sow_weights:  # the fast path's float16 dot_product_attention, compiled (see run)
                output = fallback_precision(output, rejected_algorithm(self.device, dtype))
            grads = vjp_stages(case, output, shapes, weights=params, to_canonical=nnx_state_to_canonical,
                               fast_compile=self.fast)
        return merged_heads(grads, B, T, prefix="d_")


class FlaxNNXFastAdapter(FlaxNNXAdapter):
    """``flax.nnx.MultiHeadAttention`` with ``sow_weights=False``: the core is ``jax.nn.dot_product_attention``."""

    name = "flax-nnx-fast"
    sow_weights = False
    known_deviations = [
        *declared_at("flax-nnx-fast.fully-masked", ("output",)),
        *declared_at("flax-nnx-fast.softmax-float32", ("output",)),
        *declared_at("flax-nnx-fast.fully-masked-backward", FULLY_MASKED_BACKWARD),
        *declared_at("flax-nnx-fast.softmax-float32-backward", THROUGH_SOFTMAX),
        *declared_where("flax.bias-grad-bfloat16", BIAS_GRAD_BF16_WHERE),
    ]
