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

from ..protocol.contract import Deviation
from ..spec import Case, masks
from ._jax_common import (compiled, computing_in, fallback_precision, linear, rejected_algorithm, to_jax, to_numpy,
                          use_compilation_cache, use_fast_compile, vjp_stages, with_fallback_precision)

_SOFTMAX_F32 = (
    "jax.nn.dot_product_attention always computes the softmax in float32 (its xla path casts the "
    "logits with .astype(float32)), so float64 head outputs carry float32 rounding"
)
_FULLY_MASKED = (
    "masked logits are filled with -0.7·finfo.max rather than -inf, so a query row that sees no "
    "key attends uniformly to every key instead of giving zeros (spec: all-zero head outputs, output = b_o)"
)

#: Backward stages that go through the fused softmax (d_concat, d_head_outputs, d_b_o do not).
_THROUGH_SOFTMAX = ("d_[qkv]_proj", "d_query", "d_key", "d_value", "d_w_?", "d_b_[qkv]")


def mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, weights: dict,
    taps: dict | None = None,
    *, heads: int, kv_heads: int, scale: float, is_causal: bool, dtype: str,
) -> dict[str, jax.Array]:
    """The stages around the fused call; ``taps``: zeros added to each (for ``jax.vjp``), None in the forward."""
    w = weights

    def tap(name: str, x: jax.Array) -> jax.Array:
        return x if taps is None else x + taps[name]

    q = tap("q_proj", linear(query, w["w_q"], w.get("b_q"), dtype))  # (B, T, H·D)
    k = tap("k_proj", linear(key, w["w_k"], w.get("b_k"), dtype))  # (B, S, G·D)
    v = tap("v_proj", linear(value, w["w_v"], w.get("b_v"), dtype))  # (B, S, G·E)
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
#: :func:`~._jax_common.with_fallback_precision`: the core asks dot_general for the algorithm
#: F16_F16_F32, which JAX refuses to lower for CPU, and the library's fallback to the default
#: precision only catches that error outside jit; the wrapper applies that same fallback to the
#: traced function (in the forward and, differentiated, in the backward).
STATIC = ("heads", "kv_heads", "scale", "is_causal", "dtype")


def dpa_mask(case: Case) -> tuple[np.ndarray | None, bool]:
    """(boolean mask, is_causal) for jax.nn.dot_product_attention; True = take part, as in the spec.

    Top-left causal uses its ``is_causal``; bottom-right (j <= i + S - T) is ANDed into the mask.
    Built in numpy: an eager jnp op on each case's new shape would cost one XLA compilation.
    """
    cfg, T, S = case.config, case.tgt_len, case.src_len
    mask = case.inputs.mask  # (B, 1, 1|T, S)
    if not cfg.causal or cfg.causal_alignment == "top_left":
        return mask, cfg.causal
    bottom_right = masks.causal_visible(cfg, T, S)[None, None]  # (1, 1, T, S): j <= i + S - T
    return (bottom_right if mask is None else mask & bottom_right), False


class JaxDPAAdapter:
    """The ``jax-dpa`` adapter: projections, then ``jax.nn.dot_product_attention``, then W^O."""

    name = "jax-dpa"
    framework = "jax"
    known_deviations = [
        *(Deviation(_FULLY_MASKED, stage=stage, rows="fully_masked") for stage in ("head_outputs", "concat", "output")),
        *(Deviation(_SOFTMAX_F32, dtype="float64", stage=stage, within="float32")
          for stage in ("head_outputs", "concat", "output")),
        # backward: the same two, carried into every gradient that goes through the softmax or the head outputs
        *(Deviation(_FULLY_MASKED + "; backward: those rows' uniform weights give them gradients and "
                    "pass gradient to every key", stage=stage, rows="fully_masked") for stage in _THROUGH_SOFTMAX),
        *(Deviation(_SOFTMAX_F32 + "; backward: its gradient too", dtype="float64", stage=stage, within="float32")
          for stage in _THROUGH_SOFTMAX),
    ]

    def __init__(self, *, device: str = "cpu", fast_compile: bool = True) -> None:
        self.device, self.fast_compile = device, fast_compile
        use_compilation_cache()  # compiled programs kept across runs (see _jax_common)

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.D_v != cfg.D_k:
            return (f"jax.nn.dot_product_attention needs value of the same shape as key (BSKH): "
                    f"value_head_dim D_v={cfg.D_v} != head_dim D_k={cfg.D_k}")
        return True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            weights = {k: to_jax(v, dtype) for k, v in case.weights.as_dict().items()}
            mask, is_causal = dpa_mask(case)
            inputs = (to_jax(case.inputs.query, dtype), to_jax(case.inputs.key, dtype), to_jax(case.inputs.value, dtype))
            layer = with_fallback_precision(mha, rejected_algorithm(self.device, dtype))  # see STATIC
            stages = compiled(layer, STATIC, use_fast_compile(self.device, self.fast_compile))(
                *inputs, to_jax(mask), weights, heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale, is_causal=is_causal,
                dtype=dtype,
            )
            return to_numpy(stages)

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
            return vjp_stages(case, output, {s: shapes[s] for s in names},
                              fast_compile=use_fast_compile(self.device, self.fast_compile))
