"""Sharded MHA in JAX: ``jax.shard_map`` over a mesh of host devices, one rank per device (issue 33).

Three built-in distributed adapters (:mod:`mhaspec.protocol.ranks`; the slice each rank owns:
:mod:`mhaspec.spec.ranks`), run by the ``jax`` launcher (:mod:`mhaspec.protocol.transports.jax_ranks`: one
process, ``world`` host devices, a mesh with axes ``("tp", "cp")``):

* ``jax-tp`` (tp = world): tensor parallelism.  Each device holds its heads' columns of W^Q, W^K, W^V
  (column-parallel; with H_kv < tp the key/value head its query heads read, replicated) and its heads'
  rows of W^O (row-parallel); it runs :func:`~.jax_numpy.mha` on its heads, and its W^O product
  without b_o (``o_partial``) is summed over "tp" by ``jax.lax.psum`` (one all-reduce), then b_o is
  added once.  The all-reduce sums the dtype's values, as Megatron's does.
* ``jax-ring`` (cp = world, contiguous chunks) and ``jax-ring-zigzag`` (the zigzag chunks): ring
  attention.  Each device projects its own query rows and key/value rows; at step k it holds the
  key/value chunk(s) of device (c − k) mod cp, takes the logits of its rows against them with global
  positions (the causal diagonal, the window, ALiBi, RoPE angles), softmaxes that block and merges it
  into its running output by the log-sum-exp (in the accumulator: float32 for float16 and bfloat16),
  then passes the chunk on with ``jax.lax.ppermute`` (cp − 1 times).  ``ring_out[k]`` and ``ring_lse[k]``
  are the running values after step k (the sink logit, with sinks, in the denominator of each);
  ``attn_weights`` is e^(scores − lse) of the final lse over every key.

SPMD: one compiled program computes every device's values at once.  The launcher calls ``run_rank`` for
rank 0 … world − 1 in order; the call that meets a new case runs the program (every stage has a leading
per-device axis, ``out_specs`` sharded over ("cp", "tp"): index = rank) and the others hand out their
rank's slice.  The collectives issued are counted in the compiled program's HLO text
(:func:`~.backends.jax.hlo_collectives`) and put in ``ctx.issued``.

The per-head arithmetic is the ``jax`` adapter's (:mod:`.jax_numpy`, :mod:`.backends.jax`): projections
summed in the accumulator and stored in the dtype, the logits rounded once to the dtype (``scores``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..spec import Case, masks, variant_ops
from ..spec.ranks import Layout, chunks, head_range, kv_head_range, ring_stage
from ..spec.variants import VARIANTS
from .backends.jax import (CompilingAdapter, FAST_COMPILE, accumulator, array_out, computing_in, dtype as jnp_dtype,
                           hlo_collectives, keep_mask_host, linear, projections, rope, softmax_with_lse, tapping)
from .jax_numpy import logits, mha

#: A per-device array: its leading axis (one entry per rank, rank = cp·tp + tp) split over the whole mesh.
PER_RANK = P(("cp", "tp"))
#: An array every device holds whole.
REPLICATED = P()


# -- host side: each rank's slice of the case, stacked on a leading per-rank axis ----------------------------


def stacked(world: int, piece: Any) -> np.ndarray | None:
    """(world, …): ``piece(rank)`` for every rank, stacked; None when ``piece(0)`` is None."""
    first = piece(0)
    return None if first is None else np.stack([first, *(piece(r) for r in range(1, world))])


def host(x: np.ndarray | None, name: str) -> np.ndarray | None:
    """A case array in the spec dtype ``name`` (exact: case inputs are representable in every dtype)."""
    return None if x is None else np.asarray(x, dtype=jnp_dtype(name))


def columns(heads: tuple[int, int], width: int) -> slice:
    """The columns [h0·width, h1·width) of heads [h0, h1) in a (…, heads·width) array."""
    return slice(heads[0] * width, heads[1] * width)


def head_slice(x: np.ndarray | None, heads: tuple[int, int], axis: int) -> np.ndarray | None:
    """``x``'s heads [h0, h1) on ``axis`` — unless that axis is a broadcast one (size 1)."""
    if x is None or x.shape[axis] == 1:
        return x
    return np.take(x, np.arange(*heads), axis=axis)


def tp_weights(weights: Mapping[str, np.ndarray], case: Case, layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s weights under tensor parallelism: its heads' columns of W^Q, b_Q, its key/value heads'
    of W^K, W^V, b_K, b_V (replicated when H_kv < tp), its heads' rows of W^O, its heads' sink logits; no b_o."""
    cfg = case.config
    heads, kv = head_range(layout, cfg, rank), kv_head_range(layout, cfg, rank)
    cuts = {"w_q": np.s_[:, columns(heads, cfg.D_k)], "b_q": columns(heads, cfg.D_k),
            "w_k": np.s_[:, columns(kv, cfg.D_k)], "b_k": columns(kv, cfg.D_k),
            "w_v": np.s_[:, columns(kv, cfg.D_v)], "b_v": columns(kv, cfg.D_v),
            "w_o": columns(heads, cfg.D_v), "sink_logits": slice(*heads)}
    return {name: w[cuts[name]] for name, w in weights.items() if name in cuts}


def row_starts(n: int, layout: Layout, c: int) -> np.ndarray:
    """(pieces,) int32: where each chunk of [0, ``n``) owned by cp index ``c`` starts."""
    return np.array([a for a, _ in chunks(n, layout, c)], dtype=np.int32)


def rows_of(x: np.ndarray | None, n: int, layout: Layout, c: int, axis: int) -> np.ndarray | None:
    """``x``'s positions owned by cp index ``c`` on ``axis`` (of length ``n``; a broadcast axis of size 1 as is)."""
    if x is None or x.shape[axis] == 1:
        return x
    return np.concatenate([np.take(x, np.arange(a, b), axis=axis) for a, b in chunks(n, layout, c)], axis=axis)


def alibi_term(case: Case) -> np.ndarray | None:
    """ALiBi's term (1, H, T, S) in the accumulator, or None (``spec.variant_ops.alibi``, as :func:`alibi_in`)."""
    term = variant_ops.alibi(case.config, case.T, case.S, case.T)
    return None if term is None else term[None].astype(accumulator(case.dtype))


def global_arrays(mesh: Any, args: tuple, specs: tuple[P, ...]) -> tuple:
    """Each numpy array of ``args`` (a tuple of arrays, mappings of arrays or None) as a global jax.Array laid
    out on ``mesh`` by its argument's spec: built from each device's index, so that it also works across
    processes (an argument of a multi-process program must be a global array)."""
    def place(spec: P) -> Any:
        return lambda x: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])
    return tuple(None if arg is None else jax.tree.map(place(spec), arg) for arg, spec in zip(args, specs))


def gathered(x: jax.Array) -> np.ndarray:
    """A program's output on this host: itself where every shard is here, else gathered from every process
    (``jax.experimental.multihost_utils.process_allgather``, the cluster path)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# -- the device side: what one device computes, inside shard_map --------------------------------------------


def local(tree: Any) -> Any:
    """A per-rank pytree of (1, …) blocks without its leading axis."""
    return jax.tree.map(lambda x: x[0], tree)


def per_rank(stages: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Stages with a leading per-device axis of 1 (out_specs :data:`PER_RANK`)."""
    return {name: x[None] for name, x in stages.items()}


def tp_device(query, key, value, mask, bias, alibi, weights, b_o, *, heads, kv_heads, dtype, **static):
    """One tp rank: :func:`mha` on its heads; ``o_partial`` its W^O product without b_o (B, T, d_out), summed
    over "tp" (``psum``, one all-reduce, in the dtype), b_o added once in the accumulator."""
    stages = mha(query, key, value, local(mask), local(bias), local(alibi), local(weights),
                 heads=heads, kv_heads=kv_heads, dtype=dtype, **static)
    o_partial = stages.pop("output")  # (B, T, d_out): linear() with no b_o
    total = jax.lax.psum(o_partial, "tp")
    acc = accumulator(dtype)
    out = total.astype(acc) if b_o is None else total.astype(acc) + b_o.astype(acc)
    return per_rank({**stages, "o_partial": o_partial, "output": out.astype(jnp.dtype(dtype))})


def positions(starts: jax.Array, length: int) -> jax.Array:
    """(pieces · length,) int32: the global positions of chunks of ``length`` starting at ``starts`` (pieces,)."""
    return (starts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]).reshape(-1)


def rope_pieces(x: jax.Array, heads: int, offset: int, starts: jax.Array, spec: Any, dtype: str) -> jax.Array:
    """x (B, pieces·L, heads·D) turned by RoPE, piece i's row l at global position offset + starts[i] + l."""
    pieces = starts.shape[0]
    parts = jnp.split(x, pieces, axis=1)
    return jnp.concatenate([rope(p, heads, offset + starts[i], spec, dtype) for i, p in enumerate(parts)], axis=1)


def merge(out: jax.Array, lse: jax.Array, block_out: jax.Array, block_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The log-sum-exp merge of two partial attentions (B, H, t, E), (B, H, t): weights e^(lse_i − lse);
    a side that saw no key (lse −inf) weighs 0, a row neither saw stays 0 and −inf."""
    total = jnp.logaddexp(lse, block_lse)
    seen = jnp.isfinite(total)
    safe = jnp.where(seen, total, 0)
    weigh = lambda part: jnp.where(jnp.isfinite(part) & seen, jnp.exp(part - safe), 0)[..., None]
    return out * weigh(lse) + block_out * weigh(block_lse), total


def with_sinks(out: jax.Array, lse: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(out, lse) with each head's sink logit (H,) added to the denominator, for a row that saw a key
    (a row that saw none stays 0 and −inf: the spec's rule)."""
    if sinks is None:
        return out, lse
    seen = jnp.isfinite(lse)
    total = jnp.where(seen, jnp.logaddexp(lse, sinks.astype(lse.dtype)[None, :, None]), -jnp.inf)
    return jnp.where(seen[..., None], out * jnp.exp(jnp.where(seen, lse - total, 0))[..., None], 0), total


def allowed_keys(rows: jax.Array, keys: jax.Array, mask: jax.Array | None, causal_shift: int | None) -> jax.Array:
    """(B|1, H|1, t, s) bool: row position i may see key position j — the causal band and ``mask`` (B, 1|H, 1|t, s)."""
    allowed = jnp.ones((1, 1, rows.shape[0], keys.shape[0]), dtype=bool)
    if causal_shift is not None:
        allowed = allowed & (keys[None, :] <= rows[:, None] + causal_shift)[None, None]
    return allowed if mask is None else allowed & mask


def ring_device(query, key, value, row_start, mask, bias, alibi, weights, key_starts,
                *, heads, kv_heads, scale, causal_shift, cap, rope_spec, dtype, cp):
    """One ring rank: its rows' attention over the key/value chunks passed round the ring (module docstring).
    ``row_start`` (1, pieces): its chunks' first rows; ``key_starts`` (cp, pieces): every cp index's first keys;
    ``mask`` (1, B, 1|H, 1|t, S), ``bias`` (1, B|1, H|1, t, S), ``alibi`` (1, 1, H, t, S) its rows, every key."""
    acc, dt = accumulator(dtype), jnp.dtype(dtype)
    w, starts = weights, row_start[0]
    mask, bias, alibi = local(mask), local(bias), local(alibi)
    q, k, v = projections(local(query), local(key), local(value), w, dtype, tapping(None))  # (B, t, H·D) (B, s, G·D) (B, s, G·E)
    B, t, s = q.shape[0], q.shape[1], k.shape[1]
    pieces = starts.shape[0]
    stages = {"q_proj": q, "k_proj": k, "v_proj": v}
    if rope_spec is not None:
        q = stages["q_rot"] = rope_pieces(q, heads, rope_spec.query_offset, starts, rope_spec, dtype)
        c = jax.lax.axis_index("cp")
        k = stages["k_rot"] = rope_pieces(k, kv_heads, rope_spec.key_offset, key_starts[c], rope_spec, dtype)
    rows = positions(starts, t // pieces)  # (t,) global row positions
    Q = q.reshape(B, t, kv_heads, heads // kv_heads, -1)  # BTGRD
    sinks = w.get("sink_logits")
    S = s * cp
    scores = jnp.zeros((B, heads, t, S), dtype=dt)
    out, lse = jnp.zeros((B, heads, t, v.shape[-1] // kv_heads), dtype=acc), jnp.full((B, heads, t), -jnp.inf, dtype=acc)
    held = (k, v)
    c = jax.lax.axis_index("cp")
    for step in range(cp):
        keys = positions(key_starts[(c - step) % cp], s // pieces)  # (s,) global key positions held
        cut = lambda x: None if x is None else jnp.take(x, keys, axis=-1)
        K, V = held[0].reshape(B, s, kv_heads, -1), held[1].reshape(B, s, kv_heads, -1)
        block = logits(Q, K, cut(bias), cut(alibi), scale=scale, cap=cap, dtype=dtype)  # (B, H, t, s)
        scores = scores.at[..., keys].set(block)
        p, block_lse = softmax_with_lse(block.astype(acc), allowed_keys(rows, keys, cut(mask), causal_shift), None)
        P_ = p.reshape(B, kv_heads, heads // kv_heads, t, s)
        block_out = jnp.einsum("BGRTS,BSGE->BGRTE", P_, V.astype(acc)).reshape(B, heads, t, -1)
        out, lse = merge(out, lse, block_out, block_lse)
        step_out, step_lse = with_sinks(out, lse, sinks)
        stages[ring_stage("out", step)], stages[ring_stage("lse", step)] = step_out.astype(dt), step_lse.astype(dt)
        if step < cp - 1:
            held = jax.lax.ppermute(held, "cp", [(i, (i + 1) % cp) for i in range(cp)])
    o = stages[ring_stage("out", cp - 1)]  # (B, H, t, E)
    final = step_lse  # (B, H, t) the last step's, in the accumulator: rounding it first would scale whole rows
    every = allowed_keys(rows, jnp.arange(S, dtype=jnp.int32), mask, causal_shift)
    weights_ = jnp.where(every & jnp.isfinite(final)[..., None], jnp.exp(scores.astype(acc) - final[..., None]), 0)
    concat = o.transpose(0, 2, 1, 3).reshape(B, t, -1)  # (B, t, H·E)
    stages.update({"scores": scores, "attn_weights": weights_.astype(dt), "head_outputs": o, "concat": concat,
                   "output": linear(concat, w["w_o"], w.get("b_o"), dtype)})
    stages["lse"] = stages[ring_stage("lse", cp - 1)]
    return per_rank(stages)


# -- the adapters ------------------------------------------------------------------------------------------


class ShardedJaxAdapter(CompilingAdapter):
    """What ``jax-tp`` and ``jax-ring`` share: the cache of every rank's stages, filled by the first
    ``run_rank`` call of a case, and the compiled program's collectives."""

    framework = "jax"
    launcher = "jax"
    variants = frozenset(VARIANTS)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._case: Case | None = None
        self._ranks: list[dict[str, np.ndarray]] = []
        self._issued: dict[str, int] = {}

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        """Rank ``ctx.rank``'s stages (``ctx``: a ``mhaspec.protocol.ranks.RankContext`` with the jax mesh)."""
        if self._case is not case:  # a new case (the held object: case ids repeat, e.g. in fuzz)
            self._case, self._ranks = None, []
            self._ranks, self._issued = self._compute(ctx, case)
            self._case = case
        ctx.issued.update(self._issued)
        return self._ranks[ctx.rank]

    def _compute(self, ctx: Any, case: Case) -> tuple[list[dict[str, np.ndarray]], dict[str, int]]:
        """Every rank's stages (numpy, rank order) and the collectives of the compiled program."""
        if ctx.mesh is None:
            raise ValueError(f"adapter {self.name}: run_rank needs ctx.mesh (a jax Mesh with axes ('tp', 'cp'))")
        problem = ctx.layout.problem(case.config, case.T, case.S)
        if problem is not None:
            raise ValueError(f"adapter {self.name}: case {case.id} cannot be sharded as {ctx.layout.describe()}: {problem}")
        with computing_in(case.dtype, self.device):
            body, args, specs = self._program(ctx.layout, case)
            program = jax.jit(jax.shard_map(body, mesh=ctx.mesh, in_specs=specs, out_specs=PER_RANK, check_vma=False),
                              compiler_options=FAST_COMPILE if self.fast else None)
            placed = global_arrays(ctx.mesh, args, specs)
            compiled = program.lower(*placed).compile()
            stages = {name: gathered(x) for name, x in compiled(*placed).items()}
        stages = array_out(stages)
        return [{name: x[r] for name, x in stages.items()} for r in range(ctx.world)], hlo_collectives(compiled.as_text())


class JaxTensorParallelAdapter(ShardedJaxAdapter):
    """``jax-tp``: heads over "tp" (module docstring); H_kv < tp replicates the key/value head."""

    name = "jax-tp"

    def layout(self, world: int) -> Layout:
        return Layout(tp=world, kv_heads="replicate")

    def collectives(self, world: int) -> dict[str, int]:
        return {"all_reduce": 1}

    def _program(self, layout: Layout, case: Case) -> tuple[Any, tuple, tuple]:
        cfg, dtype, world = case.config, case.dtype, layout.world
        weights = {name: host(w, dtype) for name, w in case.weights.as_dict().items()}
        heads = lambda r: head_range(layout, cfg, r)
        mask = keep_mask_host(case, window=True)  # (B, 1|H, 1|T, S) or None
        args = (host(case.inputs.query, dtype), host(case.inputs.key, dtype), host(case.inputs.value, dtype),
                stacked(world, lambda r: head_slice(mask, heads(r), 1)),
                stacked(world, lambda r: head_slice(host(case.inputs.bias, dtype), heads(r), 1)),
                stacked(world, lambda r: head_slice(alibi_term(case), heads(r), 1)),
                stacked_tree(world, lambda r: tp_weights(weights, case, layout, r)), weights.get("b_o"))
        specs = (REPLICATED, REPLICATED, REPLICATED, PER_RANK, PER_RANK, PER_RANK, PER_RANK, REPLICATED)
        kv = kv_head_range(layout, cfg, 0)
        static = dict(heads=cfg.H // layout.tp, kv_heads=kv[1] - kv[0], scale=cfg.scale, dtype=dtype,
                      causal_shift=masks.causal_offset(cfg, case.T, case.S), cap=cfg.softcap, rope_spec=cfg.rope)
        return (lambda *a: tp_device(*a, **static)), args, specs


def stacked_tree(world: int, piece: Any) -> dict[str, np.ndarray]:
    """:func:`stacked` of each array of the mapping ``piece(rank)``."""
    pieces = [piece(r) for r in range(world)]
    return {name: np.stack([p[name] for p in pieces]) for name in pieces[0]}


class JaxRingAdapter(ShardedJaxAdapter):
    """``jax-ring``: the sequence over "cp", contiguous chunks, a ``ppermute`` ring (module docstring)."""

    name = "jax-ring"
    partition = "contiguous"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="ring", partition=self.partition)

    def collectives(self, world: int) -> dict[str, int]:
        return {"send_recv": 2 * (world - 1)} if world > 1 else {}

    def _program(self, layout: Layout, case: Case) -> tuple[Any, tuple, tuple]:
        cfg, dtype, world = case.config, case.dtype, layout.world
        T, S = case.T, case.S
        mask = keep_mask_host(case, window=True)  # (B, 1|H, 1|T, S) or None
        bias, alibi = host(case.inputs.bias, dtype), alibi_term(case)
        args = (stacked(world, lambda c: rows_of(host(case.inputs.query, dtype), T, layout, c, 1)),
                stacked(world, lambda c: rows_of(host(case.inputs.key, dtype), S, layout, c, 1)),
                stacked(world, lambda c: rows_of(host(case.inputs.value, dtype), S, layout, c, 1)),
                stacked(world, lambda c: row_starts(T, layout, c)),
                stacked(world, lambda c: rows_of(mask, T, layout, c, 2)),
                stacked(world, lambda c: rows_of(bias, T, layout, c, 2)),
                stacked(world, lambda c: rows_of(alibi, T, layout, c, 2)),
                {name: host(w, dtype) for name, w in case.weights.as_dict().items()},
                np.stack([row_starts(S, layout, c) for c in range(world)]))
        specs = (PER_RANK,) * 7 + (REPLICATED, REPLICATED)
        static = dict(heads=cfg.H, kv_heads=cfg.H_kv, scale=cfg.scale, dtype=dtype, cp=layout.cp,
                      causal_shift=masks.causal_offset(cfg, T, S), cap=cfg.softcap, rope_spec=cfg.rope,
                      )
        return (lambda *a: ring_device(*a, **static)), args, specs


class JaxRingZigzagAdapter(JaxRingAdapter):
    """``jax-ring-zigzag``: ``jax-ring`` with the zigzag chunks (rank c: chunks c and 2cp − 1 − c)."""

    name = "jax-ring-zigzag"
    partition = "zigzag"
