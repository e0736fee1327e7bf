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
from ._jax_common import (accumulator, compiled, computing_in, jax_dtype, linear, to_jax, to_numpy,
                          use_compilation_cache, use_fast_compile, vjp_stages)

#: :func:`mha`'s static arguments: it is jit-compiled by :func:`~._jax_common.compiled` (the forward)
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
    acc, dt = accumulator(dtype), jax_dtype(dtype)
    w = weights

    def tap(name: str, x: jax.Array) -> jax.Array:
        return x if taps is None else x + taps[name]

    q = tap("q_proj", linear(query, w["w_q"], w.get("b_q"), dtype))  # (B, T, H·D)
    k = tap("k_proj", linear(key, w["w_k"], w.get("b_k"), dtype))  # (B, S, G·D)
    v = tap("v_proj", linear(value, w["w_v"], w.get("b_v"), dtype))  # (B, S, G·E)

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


def causal_shift(case: Case) -> int | None:
    """None when not causal; else how far the diagonal moves right: 0 (top-left) or S - T."""
    return masks.causal_offset(case.config, case.tgt_len, case.src_len)


class JaxMHAAdapter:
    """The ``jax`` adapter: :func:`mha` under ``jax.jit``, every stage.

    ``fast_compile=False`` compiles with XLA's default options (see ``_jax_common``).
    """

    name = "jax"
    framework = "jax"

    def __init__(self, *, device: str = "cpu", fast_compile: bool = True) -> None:
        self.device, self.fast_compile = device, fast_compile
        use_compilation_cache()  # compiled programs kept across runs (see _jax_common)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            weights = {k: to_jax(v, dtype) for k, v in case.weights.as_dict().items()}
            mask = to_jax(case.inputs.mask)  # True = may attend
            jitted = compiled(mha, STATIC, use_fast_compile(self.device, self.fast_compile))
            stages = jitted(
                to_jax(case.inputs.query, dtype), to_jax(case.inputs.key, dtype),
                to_jax(case.inputs.value, dtype), mask, weights,
                heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale, causal_shift=causal_shift(case), dtype=dtype,
            )
            return to_numpy(stages)

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``jax.vjp`` of :func:`mha`: the intermediate stages' gradients
        through zero taps added to each stage."""
        cfg, dtype = case.config, case.dtype
        with computing_in(dtype, self.device):
            mask = to_jax(case.inputs.mask)  # device_put: jnp.asarray would compile a conversion per mask shape

            def output(query, key, value, weights, taps):
                return mha(query, key, value, mask, weights, taps, heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale,
                           causal_shift=causal_shift(case), dtype=dtype)["output"]

            shapes = cfg.stage_shapes(case.batch, case.tgt_len, case.src_len)
            return vjp_stages(case, output, {s: shapes[s] for s in shapes if s != "output"},
                              fast_compile=use_fast_compile(self.device, self.fast_compile))
