"""MHA written with ``jax.numpy``, jit-compiled, returning every stage, with every attention variant.

The layer a JAX user would write from the spec: canonical weights used as
they are (``x @ W + b``), a boolean ``where`` softmax (rows that see no key get
0), GQA by grouping the query heads.  float64 and float32 compute natively;
float16 and bfloat16 store every stage in that dtype and sum each product in
float32 (``preferred_element_type``), as mixed-precision hardware does.

The variants of docs/spec.md §2a, in their order (the shared pieces are in
:mod:`.backends.jax`)::

    query ─ linear ─ q_proj ─ RoPE ─ q_rot (B,T,H·D) ─┐
    key   ─ linear ─ k_proj ─ RoPE ─ k_rot (B,S,G·D) ─┴─ scale·QKᵀ ─ softcap ─ + bias − ALiBi ─ scores (B,H,T,S)
    scores ─ softmax over causal AND window AND mask, sink in the denominator ─ attn_weights, lse (B,H,T)
    value ─ linear ─ V (B,S,G,E) ─ attn_weights·V ─ head_outputs (B,H,T,E) ─ concat (B,T,H·E) ─ linear ─ output

RoPE as the usual implementations do it: the angles, cos and sin in float32
(float64 in a float64 run), cast to the dtype, the rotation in the dtype.  The
logits (scale, softcap, bias and ALiBi) are taken in the accumulator and
rounded once to the dtype (the ``scores`` stage); the softmax and its
log-sum-exp in the accumulator.  The window's band goes into the mask and
ALiBi's term is made in numpy (both handed over by ``device_put``, as the mask
always was: no compilation per shape).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..spec import Case, masks
from ..spec.paging import not_paged
from ..spec.variants import VARIANTS, RopeSpec
from .backends import call_view, packing
from .backends.jax import (CompilingAdapter, accumulator, alibi_in, array_in, array_out, compiled, computing_in,
                           keep_mask, linear, pad_keys, projections, rope, score_bias, softcap, softmax_with_lse,
                           tap_shapes, tapping, tree_in, uses_variants, vjp_stages)

#: :func:`mha`'s static arguments: it is jit-compiled by :func:`~.backends.jax.compiled` (the forward)
#: or inside ``vjp_stages`` (the backward).  One program per case structure.
STATIC = ("heads", "kv_heads", "scale", "causal_shift", "cap", "rope_spec", "dtype")


def mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
    alibi: jax.Array | None, weights: dict[str, Any], taps: dict[str, jax.Array] | None = None,
    *, heads: int, kv_heads: int, scale: float, causal_shift: int | None, cap: float | None,
    rope_spec: RopeSpec | None, dtype: str,
) -> dict[str, jax.Array]:
    """Every stage of MHA with the case's variants.

    ``causal_shift``: None (not causal), 0 (top-left) or S − T (bottom-right); ``cap``: the softcap
    or None; ``rope_spec``: the resolved RoPE spec or None.  ``mask`` (B, 1|H, 1|T, S) True = may
    attend (the case's mask and its sliding window); ``bias`` (B|1, H|1, T, S) the additive bias input;
    ``alibi`` (1, H, T, S) ALiBi's term in the accumulator; ``weights["sink_logits"]`` (H,) with sinks.

    ``taps`` (for the backward pass): zeros added to each intermediate stage, so that
    ``jax.vjp`` with respect to them gives that stage's gradient; None in the forward.
    """
    w, tap = weights, tapping(taps)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (B, T, H·D), (B, S, G·D), (B, S, G·E)
    stages = {"q_proj": q, "k_proj": k, "v_proj": v}
    if rope_spec is not None:
        q = stages["q_rot"] = tap("q_rot", rope(q, heads, rope_spec.query_offset, rope_spec, dtype))  # (B, T, H·D)
        k = stages["k_rot"] = tap("k_rot", rope(k, kv_heads, rope_spec.key_offset, rope_spec, dtype))  # (B, S, G·D)
    return {**stages, **attend(q, k, v, mask, bias, alibi, w, tap, heads=heads, kv_heads=kv_heads, scale=scale,
                               causal_shift=causal_shift, cap=cap, dtype=dtype)}


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, bias: jax.Array | None,
    alibi: jax.Array | None, w: dict[str, Any], tap: Any,
    *, heads: int, kv_heads: int, scale: float, causal_shift: int | None, cap: float | None, dtype: str,
) -> dict[str, jax.Array]:
    """The stages from the scores on (scores, attn_weights, lse, head_outputs, concat, output) of q
    (B, T, H·D), k (B, S, G·D) (turned, with RoPE) and v (B, S, G·E); the other arguments as :func:`mha`'s."""
    acc, dt = accumulator(dtype), jnp.dtype(dtype)
    B, T, S, H, G = q.shape[0], q.shape[1], k.shape[1], heads, kv_heads
    Q = q.reshape(B, T, G, H // G, -1)  # BTGRD: head h = g·R + r reads kv head g = h // R
    K = k.reshape(B, S, G, -1)  # BSGD
    V = v.reshape(B, S, G, -1)  # BSGE
    stages = {}

    if bias is not None:
        bias = tap("bias", bias)  # the bias input's own gradient (d_bias), in its shape
    s = stages["scores"] = tap("scores", logits(Q, K, bias, alibi, scale=scale, cap=cap, dtype=dtype))

    allowed = jnp.ones((B, H, T, S), dtype=bool)
    if causal_shift is not None:
        allowed &= jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + causal_shift
    if mask is not None:
        allowed &= mask
    p, lse = softmax_with_lse(s.astype(acc), allowed, w.get("sink_logits"))
    p = stages["attn_weights"] = tap("attn_weights", p.astype(dt))
    stages["lse"] = lse.astype(dt)

    P = p.reshape(B, G, H // G, T, S)
    o = tap("head_outputs",
            jnp.einsum("BGRTS,BSGE->BGRTE", P, V, preferred_element_type=acc).astype(dt).reshape(B, H, T, -1))
    concat = tap("concat", o.transpose(0, 2, 1, 3).reshape(B, T, -1))  # (B, T, H·E)
    y = linear(concat, w["w_o"], w.get("b_o"), dtype)
    stages.update({"head_outputs": o, "concat": concat, "output": y})
    return stages


def logits(Q: jax.Array, K: jax.Array, bias: jax.Array | None, alibi: jax.Array | None,
           *, scale: float, cap: float | None, dtype: str) -> jax.Array:
    """The scores (B, H, T, S) the softmax sees, rounded once to the dtype: scale·QKᵀ, softcap, + bias − ALiBi,
    taken in the accumulator, of Q (B, T, G, R, D) and K (B, S, G, D) (query head g·R + r reads key head g)."""
    acc, dt = accumulator(dtype), jnp.dtype(dtype)
    B, T, G, R, _ = Q.shape
    s = jnp.einsum("BTGRD,BSGD->BGRTS", Q, K, preferred_element_type=acc).reshape(B, G * R, T, K.shape[1])
    s = s * jnp.asarray(scale, dtype=dt).astype(acc)
    if cap is not None:
        s = softcap(s, cap)
    added = score_bias(bias, alibi, acc)
    if added is not None:
        s = s + added
    return s.astype(dt)


def static_arguments(case: Case) -> dict[str, Any]:
    """:func:`mha`'s static arguments for ``case``."""
    cfg = case.config
    return dict(heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale,
                causal_shift=masks.causal_offset(cfg, case.tgt_len, case.src_len), cap=cfg.softcap,
                rope_spec=cfg.rope, dtype=case.dtype)


def arrays_in(case: Case) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
    """(mask with the sliding window's band, the bias input in the dtype, ALiBi's term in the accumulator),
    each None when absent (call inside :func:`~.backends.jax.computing_in`)."""
    return keep_mask(case, window=True), array_in(case.inputs.bias, case.dtype), alibi_in(case)


# -- a call of a schedule against a preallocated KV cache (docs/serving.md) ----------------------------------

#: :func:`decode_step`'s static arguments: one program per (n_c, rows appended) and case structure.
DECODE_STATIC = ("heads", "kv_heads", "scale", "cap", "rope_spec", "dtype")


def decode_step(
    query: jax.Array, key: jax.Array, value: jax.Array, cache: dict[str, jax.Array], t0: jax.Array,
    start: jax.Array, mask: jax.Array, bias: jax.Array | None, alibi: jax.Array | None, weights: dict[str, Any],
    *, heads: int, kv_heads: int, scale: float, cap: float | None, rope_spec: RopeSpec | None, dtype: str,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """One call against a preallocated cache, functionally: -> (the call's stages, the cache after it).

    query (B, n_c, d_model) the call's rows (the sequence's rows t0 …), key (B, n, kdim) and value
    (B, n, vdim) the rows it appends at cache rows [start, start + n); ``cache``: ``k_proj`` (B, S, G·D),
    with RoPE ``k_rot`` (what attention reads), ``v_proj`` (B, S, G·E), S its capacity (the case's S); t0
    and start are traced (int32), so every decode step of one shape is one program.  ``mask``
    (B|1, 1|H, n_c, S) True = may attend: the call's bottom-right causal band AND window AND mask, False on
    the rows not yet filled; ``bias`` (B|1, H|1, n_c, S) and ``alibi`` (1, H, n_c, S) for those keys
    (0 past the filled rows).  The key-side stages are the whole cache (B, S, ·)."""
    w, tap = weights, tapping(None)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (B, n_c, H·D), (B, n, G·D), (B, n, G·E)
    new, stages = {"k_proj": k, "v_proj": v}, {"q_proj": q}
    if rope_spec is not None:
        q = stages["q_rot"] = rope(q, heads, rope_spec.query_offset + t0, rope_spec, dtype)  # (B, n_c, H·D)
        new["k_rot"] = rope(k, kv_heads, rope_spec.key_offset + start, rope_spec, dtype)  # (B, n, G·D)
    cache = {name: jax.lax.dynamic_update_slice_in_dim(held, new[name], start, axis=1) for name, held in cache.items()}
    stages.update(cache)  # (B, S, ·)
    k = cache["k_rot"] if rope_spec is not None else cache["k_proj"]
    stages.update(attend(q, k, cache["v_proj"], mask, bias, alibi, w, tap, heads=heads, kv_heads=kv_heads,
                         scale=scale, causal_shift=None, cap=cap, dtype=dtype))
    return stages, cache


def empty_cache(case: Case) -> dict[str, jax.Array]:
    """The preallocated cache of :func:`decode_step`: zeros (B, S, ·) in the dtype, S = the case's S."""
    cfg, zeros = case.config, lambda width: jax.device_put(np.zeros((case.B, case.S, width), dtype=case.dtype))
    cache = {"k_proj": zeros(cfg.H_kv * cfg.D_k), "v_proj": zeros(cfg.H_kv * cfg.D_v)}
    if cfg.rope is not None:
        cache["k_rot"] = zeros(cfg.H_kv * cfg.D_k)
    return cache


def call_stages(stages: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    """A call's stages (numpy) cut to the L_c = ``length`` keys filled: the cache's rows (B, L_c, ·), the
    scores' and weights' columns (B, H, n_c, L_c)."""
    cut = {"k_proj": np.s_[:, :length], "k_rot": np.s_[:, :length], "v_proj": np.s_[:, :length],
           "scores": np.s_[..., :length], "attn_weights": np.s_[..., :length]}
    return {name: x[cut[name]] if name in cut else x for name, x in stages.items()}


# -- a packed case (docs/serving.md): every sequence in one (1, N) call ----------------------------------------

#: :func:`packed_mha`'s static arguments: one program per N = Σ l_b and case structure.
PACKED_STATIC = DECODE_STATIC


def packed_mha(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array, bias: jax.Array | None,
    alibi: jax.Array | None, q_shift: jax.Array, k_shift: jax.Array, weights: dict[str, Any],
    *, heads: int, kv_heads: int, scale: float, cap: float | None, rope_spec: RopeSpec | None, dtype: str,
) -> dict[str, jax.Array]:
    """Every stage of a packed call: query (1, N, d_model), key (1, N, kdim), value (1, N, vdim) the valid rows
    of every sequence, concatenated; ``mask`` (1, H, N, N) the block-diagonal rule of cu_seqlens (each block the
    sequence's causal, window and mask rule); ``bias`` (1, H|1, N, N) and ``alibi`` (1, H, N, N) on the blocks;
    ``q_shift``, ``k_shift`` (N,) int32: RoPE turns packed row l at position shift[l] + l (shift = the offset
    minus the sequence's first packed row: positions restart at each sequence)."""
    w, tap = weights, tapping(None)
    q, k, v = projections(query, key, value, w, dtype, tap)  # (1, N, H·D), (1, N, G·D), (1, N, G·E)
    stages = {"q_proj": q, "k_proj": k, "v_proj": v}
    if rope_spec is not None:
        q = stages["q_rot"] = rope(q, heads, q_shift, rope_spec, dtype)  # type: ignore[arg-type]
        k = stages["k_rot"] = rope(k, kv_heads, k_shift, rope_spec, dtype)  # type: ignore[arg-type]
    return {**stages, **attend(q, k, v, mask, bias, alibi, w, tap, heads=heads, kv_heads=kv_heads, scale=scale,
                               causal_shift=None, cap=cap, dtype=dtype)}


def packed_arrays_in(case: Case) -> tuple[jax.Array, jax.Array | None, jax.Array | None, jax.Array, jax.Array]:
    """:func:`packed_mha`'s mask, bias, ALiBi term (in the accumulator) and RoPE shifts for a packed case
    (:mod:`.backends.packing`; call inside :func:`~.backends.jax.computing_in`)."""
    term = packing.packed_alibi(case)
    rows = np.arange(int(case.cu_seqlens()[-1]))
    q_pos, k_pos = packing.packed_positions(case) if case.config.rope is not None else (rows, rows)
    return (array_in(packing.packed_allowed(case)), array_in(packing.packed_bias(case), case.dtype),
            None if term is None else jax.device_put(term.astype(accumulator(case.dtype))),
            jax.device_put((q_pos - rows).astype(np.int32)), jax.device_put((k_pos - rows).astype(np.int32)))


class JaxMHAAdapter(CompilingAdapter):
    """The ``jax`` adapter: :func:`mha` under ``jax.jit``, every stage, every variant.

    ``fast_compile=False`` compiles with XLA's default options (see :mod:`.backends.jax`).
    """

    name = "jax"
    framework = "jax"
    variants = frozenset(VARIANTS)
    packed = True  # run(case) of a packed case: packed_mha over the packed rows

    def supports(self, case: Case) -> bool | str:
        """Every case but a paged one: its decode's cache is preallocated (B, S, ·), not paged."""
        return not_paged(case)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        dtype = case.dtype
        if case.seq_lens is not None:
            return self._packed(case)
        with computing_in(dtype, self.device):
            stages = compiled(mha, STATIC, self.fast)(
                *case.inputs_as(lambda x: array_in(x, dtype)), *arrays_in(case), tree_in(case.weights.as_dict(), dtype),
                **static_arguments(case),
            )
            if not uses_variants(case):  # a spec-1.1 case's fixture has no lse to compare
                del stages["lse"]
            return array_out(stages)

    def _packed(self, case: Case) -> dict[str, np.ndarray]:
        """A packed case (docs/serving.md): :func:`packed_mha` over one (1, N = Σ l_b) batch of the valid rows
        (the NaN padding never read), its stages back in the padded layout (B, T, ·)."""
        dtype = case.dtype
        with computing_in(dtype, self.device):
            stages = compiled(packed_mha, PACKED_STATIC, self.fast)(
                *case.inputs_as(lambda x: array_in(packing.pack(case, x), dtype)), *packed_arrays_in(case),
                tree_in(case.weights.as_dict(), dtype), **{k: v for k, v in static_arguments(case).items()
                                                           if k in PACKED_STATIC},
            )
            if not uses_variants(case):  # a spec-1.1-like case's fixture has no lse to compare
                del stages["lse"]
            return packing.unpack(case, array_out(stages))

    def decode(self, case: Case) -> list[dict[str, np.ndarray]]:
        """Every stage of each call of the case's schedule (docs/serving.md): :func:`decode_step` under
        ``jax.jit`` (one program per call shape: a prefill, then one for every decode step) against a cache
        of jax arrays preallocated to the case's S (:func:`empty_cache`), returned by each call and passed
        to the next; the call's mask, bias and ALiBi are its view's (``call_view``), padded to S keys."""
        dtype, calls, out = case.dtype, case.calls(), []
        static = {name: value for name, value in static_arguments(case).items() if name in DECODE_STATIC}
        with computing_in(dtype, self.device):
            step = compiled(decode_step, DECODE_STATIC, self.fast)
            weights, cache, start = tree_in(case.weights.as_dict(), dtype), empty_cache(case), 0
            for call in calls:
                view, new = call_view(case, call), slice(start, call.cache)  # new: the key rows appended
                query, key, value = view.inputs.query, case.inputs.key[:, new], case.inputs.value[:, new]
                stages, cache = step(  # the rows cut in numpy: an eager slice of a jax array compiles per shape
                    array_in(query, dtype), array_in(key, dtype), array_in(value, dtype), cache,
                    np.int32(call.t0), np.int32(start), keep_mask(view, causal=True, window=True, keys=case.S),
                    array_in(None if view.inputs.bias is None else pad_keys(view.inputs.bias, case.S, 0.0), dtype),
                    alibi_in(view, keys=case.S), weights, **static)
                if not uses_variants(case):  # as run(): a spec-1.1 case's stages
                    del stages["lse"]
                out.append(call_stages(array_out(stages), call.cache))
                start = call.cache
        return out

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage by ``jax.vjp`` of :func:`mha`: the intermediate stages' gradients through
        zero taps added to each stage (:func:`~.backends.jax.tap_shapes`; with the variants ``d_q_rot`` and
        ``d_k_rot`` on the rotated Q and K, ``d_bias`` on the bias input, in its shape), the inputs' and
        weights' with respect to them (``d_sink_logits`` with the sinks)."""
        static = static_arguments(case)
        with computing_in(case.dtype, self.device):
            mask, bias, alibi = arrays_in(case)  # device_put: jnp.asarray would compile a conversion per shape

            def output(query, key, value, weights, taps):
                return mha(query, key, value, mask, bias, alibi, weights, taps, **static)["output"]

            return vjp_stages(case, output, tap_shapes(case), fast_compile=self.fast)
