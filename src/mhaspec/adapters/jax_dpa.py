"""``jax.nn.dot_product_attention`` for the attention core, jnp projections (and RoPE) around it.

Layout BTNH (query (B, T, H, D), key/value (B, S, H_kv, D)); GQA by passing
fewer key/value heads; boolean ``mask`` with True = take part (the spec's
polarity); ``scale`` passed through.  Its ``is_causal`` is top-left
(``jnp.tril`` of a (T, S) ones matrix), so bottom-right alignment is given as
a boolean mask instead.  The fused call exposes neither scores nor weights;
``return_residual=True`` returns its log-sum-exp (``lse``).

The variants (docs/spec.md §2a) its API takes:

* **window**: ``local_window_size=(left, right)``, query i sees keys
  i − left ≤ j ≤ i + right (``_get_window_mask`` in jax/_src/nn/functions.py):
  the spec's window with top-left alignment.  With bottom-right alignment and
  T ≠ S the band is built into the boolean mask instead.  An unbounded side is
  given as max(T, S), which no distance reaches;
* **bias** and **alibi**: its ``bias`` argument, added to the scaled logits
  before the mask: the case's bias input plus −slope·|i + off − j|, in the
  logits' dtype (float32 for the 16-bit dtypes);
* **rope**: applied to the projections before the call (jnp, as the ``jax``
  adapter does).

It has no softcap and no sinks (jax 0.10): those cases are reported
unsupported, naming the variant.

    query ─ linear ─ Q ─ RoPE ─ (B,T,H,D) ─┐
    key   ─ linear ─ K ─ RoPE ─ (B,S,G,D) ─┼─ jax.nn.dot_product_attention(bias, mask, local_window_size) ─ (B,T,H,E), lse
    value ─ linear ─ V ──────── (B,S,G,E) ─┘      ─ concat ─ linear ─ output
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..spec import Case, masks
from ..spec.variants import RopeSpec
from .backends.jax import (THROUGH_SOFTMAX, CompilingAdapter, accumulator, alibi_in, array_in, array_out, compiled,
                           computing_in, declared_at, fallback_precision, keep_mask, linear, projections,
                           rejected_algorithm, rope, score_bias, tap_shapes, tapping, tree_in, uses_variants,
                           vjp_stages, with_fallback_precision)

#: The forward stages the fused call's softmax reaches (``lse`` is returned only for a case with a variant:
#: declared with ``head_outputs``, so that a run without one does not warn that it applies to nothing).
_AFTER_SOFTMAX = ("lse|head_outputs", "concat", "output")

#: The stages around the fused call whose gradients the backward returns (through zero taps): the
#: projections, RoPE's rotated Q and K, the bias input (the call's ``bias`` argument), its output.
TAPPED = ("q_proj", "k_proj", "v_proj", "q_rot", "k_rot", "bias", "head_outputs", "concat")

#: The gradients the fused call's float32 softmax reaches: :data:`~.backends.jax.THROUGH_SOFTMAX` and the
#: variants' of the stages before it, named with the projections' (one declaration for what one mechanism
#: reaches: a run without a bias or RoPE case returns them not, and is not warned about them).
_THROUGH_SOFTMAX = (f"{THROUGH_SOFTMAX[0]}|d_bias|d_[qk]_rot", *THROUGH_SOFTMAX[1:])


def mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
    alibi: jax.Array | None, weights: dict, taps: dict | None = None,
    *, heads: int, kv_heads: int, scale: float, is_causal: bool,
    local_window_size: tuple[int, int] | None, rope_spec: RopeSpec | None, dtype: str,
) -> dict[str, jax.Array]:
    """The stages around the fused call; ``taps``: zeros added to each (for ``jax.vjp``), None in the forward.

    ``bias`` (B|1, H|1, T, S) the case's bias input, ``alibi`` (1, H, T, S) ALiBi's term (both go to the
    call's ``bias``); ``local_window_size`` is passed as it is."""
    w, tap = weights, tapping(taps)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (B, T, H·D), (B, S, G·D), (B, S, G·E)
    stages = {"q_proj": q, "k_proj": k, "v_proj": v}
    B, T, S = query.shape[0], query.shape[1], key.shape[1]
    if rope_spec is not None:
        q = stages["q_rot"] = tap("q_rot", rope(q, heads, rope_spec.query_offset, rope_spec, dtype))
        k = stages["k_rot"] = tap("k_rot", rope(k, kv_heads, rope_spec.key_offset, rope_spec, dtype))
    if bias is not None:
        bias = tap("bias", bias)  # the bias input's own gradient (d_bias), in its shape
    encoded, lse = jax.nn.dot_product_attention(
        query=q.reshape(B, T, heads, -1), key=k.reshape(B, S, kv_heads, -1), value=v.reshape(B, S, kv_heads, -1),
        bias=score_bias(bias, alibi, accumulator(dtype)), mask=mask, scale=scale,
        is_causal=is_causal, local_window_size=local_window_size, return_residual=True,
    )  # BTNH, BTN
    if taps is not None:
        encoded = encoded + taps["head_outputs"].transpose(0, 2, 1, 3)  # the stage is (B, H, T, E)
    concat = tap("concat", encoded.reshape(B, T, -1))  # (B, T, H·E)
    y = linear(concat, w["w_o"], w.get("b_o"), dtype)
    stages.update({"lse": lse.transpose(0, 2, 1), "head_outputs": encoded.transpose(0, 2, 1, 3), "concat": concat,
                   "output": y})
    return stages


#: :func:`mha` is jit-compiled with these static arguments.  In float16 on CPU through
#: :func:`~.backends.jax.with_fallback_precision`: the core asks dot_general for the algorithm
#: F16_F16_F32, which JAX refuses to lower for CPU, and the library's fallback to the default
#: precision only catches that error outside jit; the wrapper applies that same fallback to the
#: traced function (in the forward and, differentiated, in the backward).
STATIC = ("heads", "kv_heads", "scale", "is_causal", "local_window_size", "rope_spec", "dtype")


def local_window(case: Case) -> tuple[int, int] | None:
    """``local_window_size`` for the case's window: (left, right) with an unbounded side as max(T, S),
    where the alignment's offset is 0 (top-left, or T = S); else None (the band goes into the mask:
    :func:`dpa_mask`), as it is without a window."""
    cfg = case.config
    if (cfg.window_left is None and cfg.window_right is None) or masks.alignment_offset(cfg, case.T, case.S) != 0:
        return None
    unbounded = max(case.T, case.S)
    return (unbounded if cfg.window_left is None else cfg.window_left,
            unbounded if cfg.window_right is None else cfg.window_right)


def dpa_mask(case: Case) -> tuple[jax.Array | None, bool]:
    """(boolean mask, is_causal) for jax.nn.dot_product_attention; True = take part, as in the spec.

    Top-left causal uses its ``is_causal``; bottom-right (j <= i + S - T) is ANDed into the mask
    (:func:`~.backends.jax.keep_mask`), and so is a window that ``local_window_size`` cannot place
    (:func:`local_window`).
    """
    cfg = case.config
    top_left = cfg.causal_alignment == "top_left"
    has_window = cfg.window_left is not None or cfg.window_right is not None
    mask = keep_mask(case, causal=not top_left, window=has_window and local_window(case) is None)
    return mask, cfg.causal and top_left


def static_arguments(case: Case) -> dict[str, Any]:
    """:func:`mha`'s static arguments for ``case`` (but ``is_causal``: :func:`dpa_mask`)."""
    cfg = case.config
    return dict(heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale, local_window_size=local_window(case),
                rope_spec=cfg.rope, dtype=case.dtype)


def variant_arrays(case: Case) -> tuple[jax.Array | None, jax.Array | None]:
    """(the bias input (B|1, H|1, T, S) in the dtype, ALiBi's term (1, H, T, S) in the accumulator), each
    None when absent (call inside :func:`~.backends.jax.computing_in`)."""
    return array_in(case.inputs.bias, case.dtype), alibi_in(case)


class JaxDPAAdapter(CompilingAdapter):
    """The ``jax-dpa`` adapter: projections (and RoPE), then ``jax.nn.dot_product_attention``, then W^O."""

    name = "jax-dpa"
    framework = "jax"
    #: what its API takes (no softcap, no sinks in jax 0.10)
    variants = frozenset({"window", "bias", "alibi", "rope"})
    known_deviations = [
        *declared_at("jax-dpa.fully-masked", _AFTER_SOFTMAX),
        *declared_at("jax-dpa.softmax-float32", _AFTER_SOFTMAX),
        # backward: the same two, carried into every gradient that goes through the softmax or the head outputs
        *declared_at("jax-dpa.fully-masked-backward", THROUGH_SOFTMAX),
        *declared_at("jax-dpa.softmax-float32-backward", _THROUGH_SOFTMAX),
    ]

    def supports(self, case: Case) -> bool | str:
        cfg = case.config
        if cfg.D_v != cfg.D_k:
            return (f"jax.nn.dot_product_attention needs value of the same shape as key (BSKH): "
                    f"value_head_dim D_v={cfg.D_v} != head_dim D_k={cfg.D_k}")
        return True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        dtype = case.dtype
        with computing_in(dtype, self.device):
            mask, is_causal = dpa_mask(case)
            layer = with_fallback_precision(mha, rejected_algorithm(self.device, dtype))  # see STATIC
            stages = compiled(layer, STATIC, self.fast)(
                *case.inputs_as(lambda x: array_in(x, dtype)), mask, *variant_arrays(case),
                tree_in(case.weights.as_dict(), dtype), is_causal=is_causal, **static_arguments(case),
            )
            if not uses_variants(case):  # a spec-1.1 case's fixture has no lse to compare
                del stages["lse"]
            return array_out(stages)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """The backward stages by ``jax.vjp`` through the fused call: through zero taps the gradients of the
        stages around it (:data:`TAPPED`: with the variants ``d_q_rot``, ``d_k_rot`` on the rotated Q and K
        handed to the call, ``d_bias`` on the bias input, in its shape, which reaches the call's ``bias``
        argument), the inputs' and weights'.  The fused call exposes no d_scores, d_attn_weights."""
        static = static_arguments(case)
        with computing_in(case.dtype, self.device):
            mask, is_causal = dpa_mask(case)
            bias, alibi = variant_arrays(case)

            def output(query, key, value, weights, taps):
                return mha(query, key, value, mask, bias, alibi, weights, taps, is_causal=is_causal,
                           **static)["output"]

            output = fallback_precision(output, rejected_algorithm(self.device, case.dtype))  # see STATIC
            return vjp_stages(case, output, tap_shapes(case, TAPPED), fast_compile=self.fast)
