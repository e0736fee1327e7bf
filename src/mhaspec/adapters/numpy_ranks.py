"""Sharded MHA in numpy, one rank at a time, on the threads launcher (docs/distributed.md).

The numpy adapter's computation (:mod:`.numpy_mha`: ``project``, ``rope``, ``attend``, in the dtype
under test, float32 accumulation for float16/bfloat16) cut the way real sharded implementations cut
it.  Each rank returns every stage of its own slice (:mod:`mhaspec.spec.ranks` says which):

``numpy-tp`` (tp = world)
    column-parallel W^Q, W^K, W^V (the rank's heads' columns; with H_kv < tp its one key/value head,
    replicated), attention of its heads, row-parallel W^O (its heads' rows, no b_o) → ``o_partial``
    (rounded to the dtype), ``all_reduce`` (summed in rank order in the dtype), + b_o once → ``output``.
``numpy-ring``, ``numpy-ring-zigzag`` (cp = world)
    each rank projects its rows and keys; at step k it holds the key/value chunk(s) of rank
    (c − k) mod cp (one ``send_recv`` of K and V together per step after the first), attends its rows
    to them with the global positions (causal diagonal, window, ALiBi, RoPE, mask and bias of the full
    case) and merges the chunk into its running output by the log-sum-exp, in the accumulator::

        lse' = log(e^lse + e^lse_k),  out' = out·e^(lse − lse') + out_k·e^(lse_k − lse')

    starting from (0, sink logit) with sinks, (0, −inf) without → ``ring_out[k]``, ``ring_lse[k]`` (a row
    that has seen no visible key yet: 0 and −inf); ``attn_weights`` = e^(s − lse) at the end.
``numpy-ulysses`` (cp = world)
    rows → heads by ``all_to_all`` (Q, K, V: every row of the rank's H/cp heads), attention of those heads
    over the whole case, heads → rows by ``all_to_all``, then W^O and b_o on the rank's rows.
``numpy-allgather`` (cp = world)
    ``all_gather`` of K and V (every key), attention of the rank's rows, W^O and b_o.

Every variant of the numpy adapter is sliced naturally (windows, softcap, ALiBi, the bias input, sinks,
RoPE at global positions; GQA with H_kv < tp replicated).  Not sharded: decode schedules.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from ..spec import Case, MHAConfig
from ..spec.ranks import (Layout, attention_heads, attention_rows, head_range, kv_head_range, own_keys, own_rows,
                          ring_source, ring_stage)
from ..spec.variant_ops import alibi_distance, rope_positions
from ..spec.variants import VARIANTS, alibi_slope_values
from .backends import numpy as backend
from .numpy_mha import NumpyMHA, attend, precision, project, rope, rope_cos_sin, softmax_with_lse

Heads = tuple[int, int]


# -- the rank's slice of the weights and of the case ----------------------------------------------

def columns(heads: Heads, width: int) -> slice:
    """The feature columns [h0·width, h1·width) of heads [h0, h1)."""
    return slice(heads[0] * width, heads[1] * width)


def head_config(cfg: MHAConfig, heads: Heads, kv: Heads) -> MHAConfig:
    """The config of heads [h0, h1) reading key/value heads [g0, g1): H = h1 − h0, H_kv = g1 − g0, ALiBi's
    slopes those of these heads (sizes, scale, softcap and sinks unchanged).  Only for :func:`attend`."""
    slopes = alibi_slope_values(cfg)
    return cfg.model_copy(update={"num_heads": heads[1] - heads[0], "num_kv_heads": kv[1] - kv[0],
                                  "alibi_slopes": None if slopes is None else tuple(slopes[heads[0]:heads[1]])})


def head_case(case: Case, heads: Heads, kv: Heads, with_b_o: bool) -> SimpleNamespace:
    """What :func:`attend` reads of a case, for heads [h0, h1): their config, their rows of W^O (b_o only
    if ``with_b_o``), their sink logits; the dtype."""
    w = case.weights
    weights = SimpleNamespace(w_o=w.w_o[columns(heads, case.config.D_v)], b_o=w.b_o if with_b_o else None,
                              sink_logits=None if w.sink_logits is None else w.sink_logits[heads[0]:heads[1]])
    return SimpleNamespace(config=head_config(case.config, heads, kv), weights=weights, dtype=case.dtype)


def score_bias_slice(case: Case, heads: Heads, rows: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """The additive bias input (B|1, H|1, T, S) of heads [h0, h1), query ``rows``, ``keys`` -> (B|1, h|1, t, s)."""
    bias = case.inputs.bias
    if bias is None:
        return None
    if bias.shape[1] > 1:
        bias = bias[:, heads[0]:heads[1]]
    return bias[:, :, rows][..., keys]


def distance_slice(case: Case, rows: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """ALiBi's |i + off − j| (t, s) of the case's ``rows`` and ``keys``, at their global positions; None without."""
    if alibi_slope_values(case.config) is None:
        return None
    T, S = case.tgt_len, case.src_len
    return alibi_distance(case.config, T, S, T)[rows][:, keys]


def global_visibility(case: Case, heads: Heads, rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(B, h, t, s) bool: the case's visibility (causal, window, mask) of these heads, rows and keys."""
    return backend.keep_mask(case)[:, heads[0]:heads[1]][:, :, rows][..., keys]


def projections(case: Case, rows: np.ndarray, keys: np.ndarray, heads: Heads, kv: Heads
                ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    """Column-parallel projections of the case's ``rows`` (queries) and ``keys`` for query heads ``heads`` and
    key/value heads ``kv``, RoPE at the global positions -> (q_proj, k_proj, v_proj [, q_rot, k_rot]; Q, K,
    V as attention reads them: (B, t, h·D_k), (B, s, g·D_k), (B, s, g·D_v))."""
    cfg, w, inp = case.config, case.weights, case.inputs
    dt, acc = precision(case.dtype)
    qc, kc, vc = columns(heads, cfg.D_k), columns(kv, cfg.D_k), columns(kv, cfg.D_v)

    def bias(b: np.ndarray | None, cols: slice) -> np.ndarray | None:
        return None if b is None else b[cols]

    q = project(inp.query[:, rows], w.w_q[:, qc], bias(w.b_q, qc), dt, acc)  # (B, t, h·D_k)
    k = project(inp.key[:, keys], w.w_k[:, kc], bias(w.b_k, kc), dt, acc)  # (B, s, g·D_k)
    v = project(inp.value[:, keys], w.w_v[:, vc], bias(w.b_v, vc), dt, acc)  # (B, s, g·D_v)
    stages = {"q_proj": q, "k_proj": k, "v_proj": v}
    if cfg.rope is not None:
        q_pos, k_pos = rope_positions(cfg, case.tgt_len, case.src_len)
        q = stages["q_rot"] = rope(q, heads[1] - heads[0], rope_cos_sin(cfg, q_pos[rows], dt), cfg)
        k = stages["k_rot"] = rope(k, kv[1] - kv[0], rope_cos_sin(cfg, k_pos[keys], dt), cfg)
    return stages, q, k, v


def place_rows(pieces: list[np.ndarray], where: list[np.ndarray], n: int) -> np.ndarray:
    """The pieces (B, n_j, F) put at rows ``where[j]`` of one (B, n, F) array."""
    out = np.empty((pieces[0].shape[0], n, pieces[0].shape[2]), dtype=pieces[0].dtype)
    for piece, rows in zip(pieces, where):
        out[:, rows] = piece
    return out


def merge_lse(out: np.ndarray, lse: np.ndarray, out_k: np.ndarray, lse_k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two softmax-normalised partial outputs (B, h, t, D_v) and their log-sum-exps (B, h, t), merged:
    lse' = log(e^lse + e^lse_k), out' = out·e^(lse − lse') + out_k·e^(lse_k − lse') (−inf: no mass)."""
    new = np.logaddexp(lse, lse_k)
    finite = np.isfinite(new)
    base = np.where(finite, new, 0)

    def share(x: np.ndarray) -> np.ndarray:
        return np.where(np.isfinite(x) & finite, np.exp(np.where(np.isfinite(x), x, 0) - base), 0)[..., None]

    return out * share(lse) + out_k * share(lse_k), new


# -- the adapters ----------------------------------------------------------------------------------

class NumpyRanks:
    """What every numpy sharded adapter shares: the numpy adapter's dtypes and variants, the rank's
    projections, and the output of its rows (tp > 1: ``o_partial``, all-reduce, b_o once)."""

    name = "numpy-ranks"
    framework = "numpy"
    launcher = "threads"
    variants = frozenset(VARIANTS)

    def layout(self, world: int) -> Layout:
        raise NotImplementedError

    def collectives(self, world: int) -> Mapping[str, int] | None:
        """The collectives each rank issues per case, by kind."""
        return None

    def supports(self, case: Case) -> bool | str:
        if case.schedule is not None:
            return f"{self.name}: decode schedules are not sharded (the forward pass only)"
        if case.seq_lens is not None:
            return f"{self.name}: packed cases (seq_lens) are not sharded"
        return NumpyMHA().supports(case)

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        raise NotImplementedError

    # the output of the rank's rows, from its concat (B, t, h·D_v)
    def output(self, ctx: Any, case: Case, concat: np.ndarray, heads: Heads) -> dict[str, np.ndarray]:
        """``output`` of the rank's rows; tp > 1: ``o_partial`` (its heads' rows of W^O, no b_o), summed over
        the tp ranks by :meth:`reduce`, plus b_o once (:meth:`add_output_bias`)."""
        w, (dt, acc) = case.weights, precision(case.dtype)
        if ctx.layout.tp == 1:
            return {"output": project(concat, w.w_o, w.b_o, dt, acc)}
        partial = project(concat, w.w_o[columns(heads, case.config.D_v)], None, dt, acc)  # (B, t, d_out)
        return {"o_partial": partial, "output": self.add_output_bias(ctx, case, self.reduce(ctx, partial))}

    def reduce(self, ctx: Any, partial: np.ndarray) -> np.ndarray:
        """Σ over the rank's tp group of o_partial (all_reduce, in rank order, in the dtype)."""
        t = ctx.layout.tp
        group = tuple(ctx.coords.cp * t + i for i in range(t))
        return ctx.comm.all_reduce(partial, ranks=group)

    def add_output_bias(self, ctx: Any, case: Case, reduced: np.ndarray) -> np.ndarray:
        """reduced + b_o, once, in the accumulator, rounded to the dtype."""
        b_o = case.weights.b_o
        if b_o is None:
            return reduced
        dt, acc = precision(case.dtype)
        return (reduced.astype(acc) + b_o.astype(dt).astype(acc)).astype(dt)

    def own(self, ctx: Any, case: Case) -> tuple[np.ndarray, np.ndarray, Heads, Heads]:
        """(the rank's query rows, its key rows, its query heads, its key/value heads)."""
        layout, cfg = ctx.layout, case.config
        return (own_rows(layout, case.tgt_len, ctx.rank), own_keys(layout, case.src_len, ctx.rank),
                head_range(layout, cfg, ctx.rank), kv_head_range(layout, cfg, ctx.rank))

    def check(self, ctx: Any, case: Case) -> None:
        problem = ctx.layout.problem(case.config, case.tgt_len, case.src_len)
        if problem is not None:
            raise ValueError(f"{self.name}: case {case.id}: {problem}")


class NumpyTP(NumpyRanks):
    """``numpy-tp``: heads across ranks (Megatron's column-/row-parallel attention)."""

    name = "numpy-tp"

    def layout(self, world: int) -> Layout:
        return Layout(tp=world)

    def collectives(self, world: int) -> Mapping[str, int]:
        return {"all_reduce": 1} if world > 1 else {}

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        self.check(ctx, case)
        rows, keys, heads, kv = self.own(ctx, case)
        stages, q, k, v = projections(case, rows, keys, heads, kv)
        attended, _ = attend(head_case(case, heads, kv, with_b_o=False), q, k, v,
                             global_visibility(case, heads, rows, keys), score_bias_slice(case, heads, rows, keys),
                             distance_slice(case, rows, keys))
        del attended["output"]  # o_partial, before the reduction: made again by output()
        stages.update(attended)
        stages.update(self.output(ctx, case, attended["concat"], heads))
        return stages


class NumpyRing(NumpyRanks):
    """``numpy-ring``: the sequence across ranks, key/value chunks passed round a ring, merged by the LSE."""

    name = "numpy-ring"
    partition = "contiguous"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="ring", partition=self.partition)

    def collectives(self, world: int) -> Mapping[str, int]:
        return {"send_recv": world - 1} if world > 1 else {}

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        self.check(ctx, case)
        layout, cfg = ctx.layout, case.config
        dt, acc = precision(case.dtype)
        rows, keys, heads, kv = self.own(ctx, case)
        stages, q, k, v = projections(case, rows, keys, heads, kv)
        B, t, h, S = case.batch, len(rows), heads[1] - heads[0], case.src_len
        local = head_case(case, heads, kv, with_b_o=False)
        scores = np.zeros((B, h, t, S), dtype=dt)  # filled chunk by chunk
        allowed = np.zeros((B, h, t, S), dtype=bool)
        out = np.zeros((B, h, t, cfg.D_v), dtype=acc)  # the running output and log-sum-exp, in the accumulator
        lse = np.full((B, h, t), -np.inf, dtype=acc)
        if cfg.sinks:  # the sink's mass is in the denominator from the start
            lse[:] = case.weights.sink_logits[heads[0]:heads[1]].astype(dt).astype(acc)[None, :, None]
        seen = np.zeros((B, h, t), dtype=bool)
        visible = global_visibility(case, heads, rows, np.arange(S))  # (B, h, t, S): once, sliced per step
        held = np.concatenate([k, v], axis=-1)  # (B, s, g·(D_k + D_v)): one message per step
        split = k.shape[-1]
        for step in range(layout.cp):
            if step > 0:
                held = self.pass_on(ctx, held)
            held_keys = self.held_keys(ctx, case, step)
            vis = self.step_visibility(ctx, case, visible, heads, rows, held_keys)
            part, used = attend(local, q, held[..., :split], held[..., split:], vis,
                                score_bias_slice(case, heads, rows, held_keys), distance_slice(case, rows, held_keys))
            scores[..., held_keys], allowed[..., held_keys] = part["scores"], vis
            p_k, lse_k = softmax_with_lse(part["scores"].astype(acc), vis, None)  # over this chunk only
            out_k = np.einsum("BHTS,BSHE->BHTE", p_k, used["V"].astype(acc))
            out, lse = self.merge(out, lse, out_k, lse_k)
            seen |= vis.any(axis=-1)
            stages[ring_stage("out", step)] = np.where(seen[..., None], out, 0).astype(dt)
            stages[ring_stage("lse", step)] = np.where(seen, lse, -np.inf).astype(dt)
        final = np.where(seen, lse, -np.inf)[..., None]
        weights = np.where(allowed, np.exp(scores.astype(acc) - np.where(np.isfinite(final), final, 0)), 0)
        head_outputs = stages[ring_stage("out", layout.cp - 1)]
        concat = head_outputs.transpose(0, 2, 1, 3).reshape(B, t, h * cfg.D_v)
        stages.update(scores=scores, attn_weights=weights.astype(dt), head_outputs=head_outputs,
                      lse=stages[ring_stage("lse", layout.cp - 1)], concat=concat)
        stages.update(self.output(ctx, case, concat, heads))
        return stages

    def pass_on(self, ctx: Any, held: np.ndarray) -> np.ndarray:
        """Send what the rank holds to the next cp rank, receive the previous one's."""
        layout, (t, c) = ctx.layout, ctx.coords
        to, source = ((c + 1) % layout.cp) * layout.tp + t, ((c - 1) % layout.cp) * layout.tp + t
        return ctx.comm.send_recv(held, to=to, source=source)

    def held_keys(self, ctx: Any, case: Case, step: int) -> np.ndarray:
        """The key rows held at ring step ``step``: those of cp rank (c − step) mod cp."""
        layout = ctx.layout
        source = ring_source(layout, ctx.coords.cp, step)
        return own_keys(layout, case.src_len, source * layout.tp + ctx.coords.tp)

    def step_visibility(self, ctx: Any, case: Case, visible: np.ndarray, heads: Heads, rows: np.ndarray,
                        keys: np.ndarray) -> np.ndarray:
        """(B, h, t, s): the visibility of the rank's rows and the held keys, at their global positions (those of
        ``visible``, (B, h, t, S): the rank's rows against every key)."""
        return visible[..., keys]

    def merge(self, out: np.ndarray, lse: np.ndarray, out_k: np.ndarray, lse_k: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        return merge_lse(out, lse, out_k, lse_k)


class NumpyRingZigzag(NumpyRing):
    """``numpy-ring-zigzag``: the ring over the zigzag partition (rank c owns chunks c and 2cp − 1 − c)."""

    name = "numpy-ring-zigzag"
    partition = "zigzag"


class NumpyUlysses(NumpyRanks):
    """``numpy-ulysses``: all_to_all trades rows for heads (DeepSpeed-Ulysses), attention, and back."""

    name = "numpy-ulysses"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="ulysses")

    def collectives(self, world: int) -> Mapping[str, int]:
        return {"all_to_all": 4} if world > 1 else {}

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        self.check(ctx, case)
        layout, cfg, T, S = ctx.layout, case.config, case.tgt_len, case.src_len
        rows, keys, heads, kv = self.own(ctx, case)
        stages, q, k, v = projections(case, rows, keys, heads, kv)
        peers = [c * layout.tp + ctx.coords.tp for c in range(layout.cp)]  # the rank's cp group, by cp index
        shares = [attention_heads(layout, cfg, p) for p in peers]  # each peer's query heads
        kv_shares = [(a // cfg.group_size, (b - 1) // cfg.group_size + 1) for a, b in shares]
        share, kv_share = shares[ctx.coords.cp], kv_shares[ctx.coords.cp]
        all_rows, all_keys = attention_rows(layout, T, ctx.rank), np.arange(S)

        def to_heads(x: np.ndarray, per_peer: list[Heads], first: int, width: int, n: int, where: list[np.ndarray]
                     ) -> np.ndarray:  # (B, own rows, heads·width) -> (B, every row, share·width)
            pieces = [x[:, :, columns((a - first, b - first), width)] for a, b in per_peer]
            return place_rows(self.all_to_all(ctx, pieces, peers), where, n)

        q_rows = [own_rows(layout, T, p) for p in peers]
        k_rows = [own_keys(layout, S, p) for p in peers]
        Q = to_heads(q, shares, heads[0], cfg.D_k, T, q_rows)  # (B, T, share·D_k)
        K = to_heads(k, kv_shares, kv[0], cfg.D_k, S, k_rows)  # (B, S, g·D_k)
        V = to_heads(v, kv_shares, kv[0], cfg.D_v, S, k_rows)  # (B, S, g·D_v)
        attended, _ = attend(head_case(case, share, kv_share, with_b_o=False), Q, K, V,
                             global_visibility(case, share, all_rows, all_keys),
                             score_bias_slice(case, share, all_rows, all_keys), distance_slice(case, all_rows, all_keys))
        stages.update({name: attended[name] for name in ("scores", "attn_weights", "lse", "head_outputs")})
        concat = stages["concat"] = self.heads_to_rows(ctx, attended["concat"], q_rows, peers)
        stages.update(self.output(ctx, case, concat, heads))
        return stages

    def all_to_all(self, ctx: Any, pieces: list[np.ndarray], peers: list[int]) -> list[np.ndarray]:
        return ctx.comm.all_to_all(pieces, ranks=tuple(peers))

    def heads_to_rows(self, ctx: Any, concat: np.ndarray, rows: list[np.ndarray], peers: list[int]) -> np.ndarray:
        """The second all_to_all: concat (B, T, share·D_v) of the rank's heads, every row -> (B, t, h·D_v) of
        its own rows, every head of its tp group (the peers' shares in head order)."""
        back = self.all_to_all(ctx, [concat[:, r] for r in rows], peers)  # each (B, t, share_j·D_v)
        return np.concatenate(back, axis=-1)


class NumpyAllgather(NumpyRanks):
    """``numpy-allgather``: every rank gathers every key and value, then attends its own rows."""

    name = "numpy-allgather"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="allgather")

    def collectives(self, world: int) -> Mapping[str, int]:
        return {"all_gather": 1} if world > 1 else {}

    def run_rank(self, ctx: Any, case: Case) -> dict[str, np.ndarray]:
        self.check(ctx, case)
        layout, S = ctx.layout, case.src_len
        rows, keys, heads, kv = self.own(ctx, case)
        stages, q, k, v = projections(case, rows, keys, heads, kv)
        peers = [c * layout.tp + ctx.coords.tp for c in range(layout.cp)]
        split = k.shape[-1]
        gathered = ctx.comm.all_gather(np.concatenate([k, v], axis=-1), ranks=tuple(peers))
        held = place_rows(gathered, [own_keys(layout, S, p) for p in peers], S)  # (B, S, g·(D_k + D_v))
        all_keys = np.arange(S)
        attended, _ = attend(head_case(case, heads, kv, with_b_o=False), q, held[..., :split], held[..., split:],
                             global_visibility(case, heads, rows, all_keys), score_bias_slice(case, heads, rows, all_keys),
                             distance_slice(case, rows, all_keys))
        del attended["output"]
        stages.update(attended)
        stages.update(self.output(ctx, case, attended["concat"], heads))
        return stages
