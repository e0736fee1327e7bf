"""``jax.nn.dot_product_attention`` for the attention core, jnp projections around it.

Layout BTNH (query (B, T, H, D), key/value (B, S, H_kv, D)); GQA by passing
fewer key/value heads; boolean ``mask`` with True = take part (the spec's
polarity); ``scale`` passed through.  Its ``is_causal`` is top-left
(``jnp.tril`` of a (T, S) ones matrix), so bottom-right alignment is given as
a boolean mask instead.  The fused call exposes neither scores nor weights.

    query ─ linear ─ Q (B,T,H,D) ─┐
    key   ─ linear ─ K (B,S,G,D) ─┼─ jax.nn.dot_product_attention ─ (B,T,H,E) ─ concat ─ linear ─ output
    value ─ linear ─ V (B,S,G,E) ─┘
"""

from __future__ import annotations

import jax
import numpy as np

from ..spec import Case
from .backends.jax import (THROUGH_SOFTMAX, CompilingAdapter, array_in, array_out, compiled, computing_in,
                           declared_at, fallback_precision, keep_mask, linear, projections, rejected_algorithm,
                           tapping, tree_in, vjp_stages, with_fallback_precision)

#: The forward stages the fused call's softmax reaches.
_AFTER_SOFTMAX = ("head_outputs", "concat", "output")


def mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, weights: dict,
    taps: dict | None = None,
    *, heads: int, kv_heads: int, scale: float, is_causal: bool, dtype: str,
) -> dict[str, jax.Array]:
    """The stages around the fused call; ``taps``: zeros added to each (for ``jax.vjp``), None in the forward."""
    w, tap = weights, tapping(taps)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (B, T, H·D), (B, S, G·D), (B, S, G·E)
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    encoded = jax.nn.dot_product_attention(
        query=q.reshape(B, T, heads, -1), key=k.reshape(B, S, kv_heads, -1), value=v.reshape(B, S, kv_heads, -1),
        mask=mask, scale=scale, is_causal=is_causal,
    )  # BTNH
    if taps is not None:
        encoded = encoded + taps["head_outputs"].transpose(0, 2, 1, 3)  # the stage is (B, H, T, E)
    concat = tap("concat", encoded.reshape(B, T, -1))  # (B, T, H·E)
    y = linear(concat, w["w_o"], w.get("b_o"), dtype)
    return {
        "q_proj": q, "k_proj": k, "v_proj": v,
        "head_outputs": encoded.transpose(0, 2, 1, 3), "concat": concat, "output": y,
    }


#: :func:`mha` is jit-compiled with these static arguments.  In float16 on CPU through
#: :func:`~.backends.jax.with_fallback_precision`: the core asks dot_general for the algorithm
#: F16_F16_F32, which JAX refuses to lower for CPU, and the library's fallback to the default
#: precision only catches that error outside jit; the wrapper applies that same fallback to the
#: traced function (in the forward and, differentiated, in the backward).
STATIC = ("heads", "kv_heads", "scale", "is_causal", "dtype")


def dpa_mask(case: Case) -> tuple[jax.Array | None, bool]:
    """(boolean mask, is_causal) for jax.nn.dot_product_attention; True = take part, as in the spec.

    Top-left causal uses its ``is_causal``; bottom-right (j <= i + S - T) is ANDed into the mask
    (:func:`~.backends.jax.keep_mask`).
    """
    top_left = case.config.causal_alignment == "top_left"
    return keep_mask(case, causal=not top_left), case.config.causal and top_left


class JaxDPAAdapter(CompilingAdapter):
    """The ``jax-dpa`` adapter: projections, then ``jax.nn.dot_product_attention``, then W^O."""

    name = "jax-dpa"
    framework = "jax"
    known_deviations = [
        *declared_at("jax-dpa.fully-masked", _AFTER_SOFTMAX),
        *declared_at("jax-dpa.softmax-float32", _AFTER_SOFTMAX),
        # backward: the same two, carried into every gradient that goes through the softmax or the head outputs
        *declared_at("jax-dpa.fully-masked-backward", THROUGH_SOFTMAX),
        *declared_at("jax-dpa.softmax-float32-backward", THROUGH_SOFTMAX),
    ]

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.D_v != cfg.D_k:
            return (f"jax.nn.dot_product_attention needs value of the same shape as key (BSKH): "
                    f"value_head_dim D_v={cfg.D_v} != head_dim D_k={cfg.D_k}")
        return True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            mask, is_causal = dpa_mask(case)
            layer = with_fallback_precision(mha, rejected_algorithm(self.device, dtype))  # see STATIC
            stages = compiled(layer, STATIC, self.fast)(
                *case.inputs_as(lambda x: array_in(x, dtype)), mask, tree_in(case.weights.as_dict(), dtype),
                heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale, is_causal=is_causal, dtype=dtype,
            )
            return array_out(stages)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``jax.vjp`` through the fused call: the projections', head outputs'
        and concat's gradients through zero taps (the fused call exposes no d_scores, d_attn_weights)."""
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            mask, is_causal = dpa_mask(case)

            def output(query, key, value, weights, taps):
                return mha(query, key, value, mask, weights, taps, heads=cfg.H, kv_heads=cfg.H_kv,
                           scale=cfg.scale, is_causal=is_causal, dtype=dtype)["output"]

            shapes = cfg.stage_shapes(case.batch, case.tgt_len, case.src_len)
            names = ("q_proj", "k_proj", "v_proj", "head_outputs", "concat")
            output = fallback_precision(output, rejected_algorithm(self.device, dtype))  # see STATIC
            return vjp_stages(case, output, {s: shapes[s] for s in names}, fast_compile=self.fast)
