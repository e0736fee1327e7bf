"""MHA written with ``jax.numpy``, jit-compiled, returning every stage.

The layer a JAX user would write from the spec: canonical weights used as
they are (``x @ W + b``), a boolean ``where`` softmax (``jax.nn.softmax``
gives 0 to masked entries and to rows that see no key), GQA by grouping the
query heads.  float64 and float32 compute natively; float16 and bfloat16
store every stage in that dtype and sum each product in float32
(``preferred_element_type``), as mixed-precision hardware does.

    query ─ linear ─ Q (B,T,H,D) ─┐
    key   ─ linear ─ K (B,S,G,D) ─┴─ scores (B,H,T,S) ─ softmax(where=allowed) ─┐
    value ─ linear ─ V (B,S,G,E) ───────────────────────────────────────────────┴─ head_outputs (B,H,T,E)
    head_outputs ─ concat (B,T,H·E) ─ linear ─ output (B,T,d_out)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..spec import Case, masks
from .backends.jax import (CompilingAdapter, accumulator, array_in, array_out, compiled, computing_in, keep_mask,
                           linear, projections, tapping, tree_in, vjp_stages)

#: :func:`mha`'s static arguments: it is jit-compiled by :func:`~.backends.jax.compiled` (the forward)
#: or inside ``vjp_stages`` (the backward).
STATIC = ("heads", "kv_heads", "scale", "causal_shift", "dtype")


def mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, weights: dict[str, Any],
    taps: dict[str, jax.Array] | None = None,
    *, heads: int, kv_heads: int, scale: float, causal_shift: int | None, dtype: str,
) -> dict[str, jax.Array]:
    """Every stage of MHA.  ``causal_shift``: None (not causal), 0 (top-left) or S - T (bottom-right).

    ``taps`` (for the backward pass): zeros added to each intermediate stage, so that
    ``jax.vjp`` with respect to them gives that stage's gradient; None in the forward.
    """
    acc, dt, w, tap = accumulator(dtype), jnp.dtype(dtype), weights, tapping(taps)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (B, T, H·D), (B, S, G·D), (B, S, G·E)

    B, T, S, H, G = query.shape[0], query.shape[1], key.shape[1], heads, kv_heads
    Q = q.reshape(B, T, G, H // G, -1)  # BTGRD: head h = g·R + r reads kv head g = h // R
    K = k.reshape(B, S, G, -1)  # BSGD
    V = v.reshape(B, S, G, -1)  # BSGE

    s = jnp.einsum("BTGRD,BSGD->BGRTS", Q, K, preferred_element_type=acc)
    s = tap("scores", (s * jnp.asarray(scale, dtype=dt).astype(acc)).astype(dt).reshape(B, H, T, S))

    allowed = jnp.ones((B, H, T, S), dtype=bool)
    if causal_shift is not None:
        allowed &= jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + causal_shift
    if mask is not None:
        allowed &= mask
    p = tap("attn_weights", jax.nn.softmax(s.astype(acc), axis=-1, where=allowed).astype(dt))

    P = p.reshape(B, G, H // G, T, S)
    o = tap("head_outputs",
            jnp.einsum("BGRTS,BSGE->BGRTE", P, V, preferred_element_type=acc).astype(dt).reshape(B, H, T, -1))
    concat = tap("concat", o.transpose(0, 2, 1, 3).reshape(B, T, -1))  # (B, T, H·E)
    y = linear(concat, w["w_o"], w.get("b_o"), dtype)
    return {
        "q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p,
        "head_outputs": o, "concat": concat, "output": y,
    }


class JaxMHAAdapter(CompilingAdapter):
    """The ``jax`` adapter: :func:`mha` under ``jax.jit``, every stage.

    ``fast_compile=False`` compiles with XLA's default options (see :mod:`.backends.jax`).
    """

    name = "jax"
    framework = "jax"

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            stages = compiled(mha, STATIC, self.fast)(
                *case.inputs_as(lambda x: array_in(x, dtype)), keep_mask(case), tree_in(case.weights.as_dict(), dtype),
                heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale,
                causal_shift=masks.causal_offset(cfg, case.tgt_len, case.src_len), dtype=dtype,
            )
            return array_out(stages)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``jax.vjp`` of :func:`mha`: the intermediate stages' gradients
        through zero taps added to each stage."""
        cfg, dtype = case.config, case.dtype
        shift = masks.causal_offset(cfg, case.tgt_len, case.src_len)
        with computing_in(dtype, self.device):
            mask = keep_mask(case)  # device_put: jnp.asarray would compile a conversion per mask shape

            def output(query, key, value, weights, taps):
                return mha(query, key, value, mask, weights, taps, heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale,
                           causal_shift=shift, dtype=dtype)["output"]

            shapes = cfg.stage_shapes(case.batch, case.tgt_len, case.src_len)
            return vjp_stages(case, output, {s: shapes[s] for s in shapes if s != "output"}, fast_compile=self.fast)
