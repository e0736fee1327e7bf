"""Sharded attention on torch.distributed (gloo on the CPU): one rank each, ``run_rank(ctx, case)``
(docs/distributed.md; the slice each rank owns: :mod:`mhaspec.spec.ranks`).

* ``torch-tp`` (:class:`TorchTensorParallel`) — DTensor tensor parallelism around the ``torch`` adapter's
  :class:`~.torch_layer.MultiHeadAttention`: ``parallelize_module`` with ``ColwiseParallel`` on q_proj,
  k_proj, v_proj and ``RowwiseParallel`` on out_proj over a 1-D device mesh (tp = world).  The rank's
  stages are its local shards (``use_local_output``: the projections' outputs are the rank's columns).
  With H_kv < tp, k_proj and v_proj stay replicated (every rank projects all H_kv heads and keeps the one
  its query heads read): ``ColwiseParallel`` there cuts a head's columns across ranks (docs/distributed.md).
* ``torch-ring``, ``torch-ring-zigzag`` (:class:`TorchRing`) — ring attention (cp = world): the rank's
  rows and keys, key/value blocks passed to the next rank by ``dist.batch_isend_irecv``, each block's
  attention merged into the running output by the log-sum-exp (in float32, float64 for float64), global
  causal offsets (the case's visibility, sliced by global row and key).
* ``torch-ulysses`` (:class:`TorchUlysses`) — Ulysses (cp = world): ``all_to_all_single`` trades the rank's
  rows of every head for every row of its heads' share, attention, and trades back.

Every rank holds the whole case; weights are the ``torch`` adapter's (``canonical_to_state_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..protocol.ranks import RankContext
from ..spec import Case, variant_ops
from ..spec.ranks import (Layout, attention_heads, attention_rows, head_range, kv_head_range, own_keys, own_rows,
                          ring_source, ring_stage)
from ..spec.variants import VARIANTS
from .backends import torch as backend
from .torch_layer import MultiHeadAttention, canonical_to_state_dict, softmax_with_sinks

Span = tuple[int, int]  # [start, end) of heads


# -- the attention of a block: heads × rows × keys, positions global -------------------------------------------


def _heads(x: torch.Tensor | None, heads: Span) -> torch.Tensor | None:
    """x (B|1, H|1, …) -> its heads [h0, h1) (a broadcast head axis of 1 stays)."""
    return x if x is None or x.shape[1] == 1 else x[:, heads[0]:heads[1]]


def _block(x: torch.Tensor | None, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """x (…, T|1, S|1) -> (…, t|1, s|1): the global rows ``rows`` (t,) and keys ``keys`` (s,) (a broadcast
    axis of 1 stays)."""
    if x is None:
        return x
    x = x if x.shape[-2] == 1 else x.index_select(-2, rows)
    return x if x.shape[-1] == 1 else x.index_select(-1, keys)


def attend(case: Case, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, heads: Span, rows: np.ndarray,
           keys: np.ndarray, sinks: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The stages scores, attn_weights (B, h, t, s), lse (B, h, t), head_outputs (B, h, t, E) of query heads
    ``heads`` over global query rows ``rows`` (t,) and keys ``keys`` (s,): Q (B, h, t, D_k), K (B, h, s, D_k),
    V (B, h, s, D_v) already read per query head.  The order of the ``torch`` adapter's forward (scale·QKᵀ,
    softcap, + bias, + ALiBi, mask, softmax with the sinks' logits ``sinks`` (h,) or None); the bias,
    ALiBi and the visibility (explicit mask AND causal AND window) are the whole case's, sliced: the
    causal diagonal and the distances are global."""
    cfg, dev = case.config, Q.device
    r, k = torch.from_numpy(rows), torch.from_numpy(keys)
    scores = (Q @ K.transpose(-2, -1)) * cfg.scale  # (B, h, t, s)
    if cfg.softcap is not None:
        scores = backend.softcap(scores, cfg.softcap)
    if case.inputs.bias is not None:
        bias = backend.array_in(case.inputs.bias, case.dtype, dev)  # (B|1, H|1, T, S)
        scores = scores + _block(_heads(bias, heads), r, k)
    term = backend.alibi(cfg, case.tgt_len, case.src_len, scores.dtype, dev)  # (H, T, S)
    if term is not None:
        scores = scores + _block(term[heads[0]:heads[1]], r, k)
    allowed = _block(_heads(backend.keep_mask(case, dev), heads), r, k)  # (B|1, h|1, t, s)
    attn_weights, lse = softmax_with_sinks(scores, allowed, sinks)
    return {"scores": scores, "attn_weights": attn_weights, "lse": lse, "head_outputs": attn_weights @ V}


def per_query_head(x: torch.Tensor, heads: Span, kv: Span, group: int) -> torch.Tensor:
    """x (B, g, L, ·), key/value heads [g0, g1) -> (B, h, L, ·): query head h of [h0, h1) reads kv head h // group."""
    index = torch.arange(heads[0], heads[1]) // group - kv[0]
    return x.index_select(1, index)


def split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, L, heads·D) -> (B, heads, L, D)."""
    B, L, F = x.shape
    return x.view(B, L, heads, F // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, h, L, E) -> (B, L, h·E) (head order)."""
    B, h, L, E = x.shape
    return x.transpose(1, 2).reshape(B, L, h * E)


def turned(case: Case, q: torch.Tensor, k: torch.Tensor, rows: np.ndarray, keys: np.ndarray
           ) -> dict[str, torch.Tensor]:
    """RoPE of the rank's q (B, t, h·D_k) and k (B, s, g·D_k) at their global positions: {q_rot, k_rot}
    ({} without RoPE)."""
    cfg = case.config
    if cfg.rope is None:
        return {}
    q_pos, k_pos = variant_ops.rope_positions(cfg, case.tgt_len, case.src_len)
    D = cfg.D_k
    return {"q_rot": backend.rope(q, q.shape[-1] // D, torch.from_numpy(q_pos[rows]), cfg),
            "k_rot": backend.rope(k, k.shape[-1] // D, torch.from_numpy(k_pos[keys]), cfg)}


def module_for(case: Case) -> MultiHeadAttention:
    """The ``torch`` adapter's module for ``case``, loaded with its weights in its dtype, on the CPU."""
    return backend.loaded_module(MultiHeadAttention, canonical_to_state_dict(case.weights), case, "cpu",
                                 **case.config.model_dump())


def inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query (B, T, d_model), key (B, S, kdim), value (B, S, vdim)) in the case's dtype."""
    return case.inputs_as(lambda x: backend.array_in(x, case.dtype))


def numpy_stages(stages: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: backend.array_out(t) for name, t in stages.items()}


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a ring keeps its running output and log-sum-exp in: float32 (float64 for float64)."""
    return torch.promote_types(dtype, torch.float32)


def peer(layout: Layout, rank: int, cp: int) -> int:
    """The rank of cp index ``cp`` in ``rank``'s tp column."""
    return (cp % layout.cp) * layout.tp + layout.coords(rank).tp


class _TorchRanks:
    """What the torch.distributed adapters share: torch, every dtype gloo reduces, every variant."""

    framework = "torch"
    launcher = "torch"
    variants = frozenset(VARIANTS)
    dtypes = ("float64", "float32", "float16", "bfloat16")

    def __init__(self) -> None:
        torch.set_num_threads(1)


# -- tensor parallelism: DTensor ----------------------------------------------------------------------------


class TorchTensorParallel(_TorchRanks):
    """``torch-tp``: DTensor ``ColwiseParallel`` (q, k, v) and ``RowwiseParallel`` (out) over tp = world ranks."""

    name = "torch-tp"

    def __init__(self) -> None:
        super().__init__()
        self._mesh: Any = None

    def layout(self, world: int) -> Layout:
        return Layout(tp=world, kv_heads="replicate")

    def collectives(self, world: int) -> dict[str, int]:
        """Per rank and forward: RowwiseParallel's one all-reduce of the out projection."""
        return {"all_reduce": 1}

    def mesh(self, world: int) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None or self._mesh.size() != world:
            self._mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return self._mesh

    def shards_kv(self, config: Any, layout: Layout) -> bool:
        """Whether k_proj and v_proj are ``ColwiseParallel`` (H_kv ≥ tp) or replicated (H_kv < tp)."""
        return config.H_kv >= layout.tp

    def parallelized(self, case: Case, layout: Layout, world: int) -> MultiHeadAttention:
        """The module with its projections sharded by heads: k_proj and v_proj replicated when H_kv < tp."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan: dict[str, Any] = {"q_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
        if self.shards_kv(case.config, layout):
            plan.update(k_proj=ColwiseParallel(), v_proj=ColwiseParallel())
        # src_data_rank=None: every rank holds the case's weights and shards them itself (no scatter)
        return parallelize_module(module_for(case), self.mesh(world), plan, src_data_rank=None)

    def run_rank(self, ctx: RankContext, case: Case) -> dict[str, np.ndarray]:
        cfg, layout = case.config, ctx.layout
        heads, kv = head_range(layout, cfg, ctx.rank), kv_head_range(layout, cfg, ctx.rank)
        h, g = heads[1] - heads[0], kv[1] - kv[0]
        module = self.parallelized(case, layout, ctx.world)
        sharded_kv = self.shards_kv(cfg, layout)
        rows, keys = np.arange(case.tgt_len), np.arange(case.src_len)
        query, key, value = inputs(case)
        with torch.no_grad():
            stages = {"q_proj": module.q_proj(query),  # (B, T, h·D_k): the local shard
                      "k_proj": module.k_proj(key), "v_proj": module.v_proj(value)}  # (B, S, g·D) (or all H_kv)
            if not sharded_kv:  # replicated: every H_kv head here, keep the one this rank's heads read
                stages["k_proj"] = stages["k_proj"][..., kv[0] * cfg.D_k:kv[1] * cfg.D_k]
                stages["v_proj"] = stages["v_proj"][..., kv[0] * cfg.D_v:kv[1] * cfg.D_v]
            stages.update(turned(case, stages["q_proj"], stages["k_proj"], rows, keys))
            Q = split(stages.get("q_rot", stages["q_proj"]), h)  # (B, h, T, D_k)
            K = per_query_head(split(stages.get("k_rot", stages["k_proj"]), g), heads, kv, cfg.group_size)
            V = per_query_head(split(stages["v_proj"], g), heads, kv, cfg.group_size)  # (B, h, S, D_v)
            sinks = None if module.sink_logits is None else module.sink_logits[heads[0]:heads[1]]
            stages.update(attend(case, Q, K, V, heads, rows, keys, sinks))
            concat = stages["concat"] = merge_heads(stages["head_outputs"])  # (B, T, h·D_v)
            weight = module.out_proj.weight.to_local()  # (d_out, h·D_v): the rank's rows of W^O
            stages["o_partial"] = torch.nn.functional.linear(concat, weight)  # (B, T, d_out), no b_o
            stages["output"] = self.reduce(ctx, module, concat)
        return numpy_stages(stages)

    def reduce(self, ctx: RankContext, module: MultiHeadAttention, concat: torch.Tensor) -> torch.Tensor:
        """concat (B, T, h·D_v), the rank's columns -> output (B, T, d_out): ``RowwiseParallel``'s product,
        its all-reduce, b_o once."""
        return module.out_proj(concat)


# -- context parallelism: ring and Ulysses -----------------------------------------------------------------


def own_projections(case: Case, module: MultiHeadAttention, rows: np.ndarray, keys: np.ndarray
                    ) -> dict[str, torch.Tensor]:
    """q_proj (B, t, H·D_k) of the rank's rows, k_proj (B, s, H_kv·D_k) and v_proj (B, s, H_kv·D_v) of its
    keys, and q_rot, k_rot at their global positions."""
    query, key, value = inputs(case)
    r, k = torch.from_numpy(rows), torch.from_numpy(keys)
    stages = {"q_proj": module.q_proj(query.index_select(1, r)), "k_proj": module.k_proj(key.index_select(1, k)),
              "v_proj": module.v_proj(value.index_select(1, k))}
    stages.update(turned(case, stages["q_proj"], stages["k_proj"], rows, keys))
    return stages


def merge_lse(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out (B, h, t, E), lse (B, h, t)) merged with a block's: lse' = log(e^lse + e^lse_b),
    out' = out·e^(lse − lse') + out_b·e^(lse_b − lse'); a row that has seen no key in either stays 0, −inf."""
    new = torch.logaddexp(lse, block_lse)  # (B, h, t)
    none = torch.isneginf(new)
    safe = torch.where(none, 0.0, new)
    a = torch.where(none, 0.0, torch.exp(lse - safe))[..., None]
    b = torch.where(none, 0.0, torch.exp(block_lse - safe))[..., None]
    return out * a + block_out * b, new


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) over the keys seen, with the sinks' logits (h,) in the denominator once (a
    row that has seen no visible key: 0, −inf, the spec's rule with or without a sink)."""
    if sinks is None:
        return out, lse
    seen = ~torch.isneginf(lse)
    total = torch.where(seen, torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None]), lse)  # (B, h, t)
    scale = torch.where(seen, torch.exp(lse - torch.where(seen, total, 0.0)), 0.0)[..., None]
    return out * scale, total


def ring_pass(ctx: RankContext, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor sent to the next cp rank and replaced by the previous one's (``batch_isend_irecv``)."""
    c = ctx.coords.cp
    to, source = peer(ctx.layout, ctx.rank, c + 1), peer(ctx.layout, ctx.rank, c - 1)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, group=ctx.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, source, group=ctx.group) for r in received]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class TorchRing(_TorchRanks):
    """``torch-ring`` / ``torch-ring-zigzag``: ring attention over cp = world ranks, send/recv and an LSE merge."""

    #: how a block's (out, lse) joins the running one
    merge = staticmethod(merge_lse)

    def __init__(self, partition: str = "contiguous") -> None:
        super().__init__()
        self.partition = partition
        self.name = "torch-ring" if partition == "contiguous" else f"torch-ring-{partition}"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="ring", partition=self.partition)  # type: ignore[arg-type]

    def collectives(self, world: int) -> dict[str, int]:
        """Per rank and forward: the key and value blocks sent on at each of the world − 1 steps."""
        return {"send_recv": 2 * (world - 1)}

    def run_rank(self, ctx: RankContext, case: Case) -> dict[str, np.ndarray]:
        cfg, layout, c = case.config, ctx.layout, ctx.coords.cp
        heads, kv = attention_heads(layout, cfg, ctx.rank), kv_head_range(layout, cfg, ctx.rank)
        rows, keys = own_rows(layout, case.tgt_len, ctx.rank), own_keys(layout, case.src_len, ctx.rank)
        module = module_for(case)
        with torch.no_grad():
            stages = own_projections(case, module, rows, keys)
            Q = split(stages.get("q_rot", stages["q_proj"]), cfg.H)  # (B, H, t, D_k)
            K = split(stages.get("k_rot", stages["k_proj"]), cfg.H_kv)  # (B, H_kv, s, D_k)
            V = split(stages["v_proj"], cfg.H_kv)  # (B, H_kv, s, D_v)
            work = work_dtype(Q.dtype)
            B, t, E = Q.shape[0], len(rows), cfg.D_v
            out = torch.zeros(B, cfg.H, t, E, dtype=work)  # (B, H, t, E): nothing seen yet
            lse = torch.full((B, cfg.H, t), float("-inf"), dtype=work)  # (B, H, t)
            scores = torch.empty(B, cfg.H, t, case.src_len, dtype=Q.dtype)  # (B, H, t, S), block by block
            sinks = None if module.sink_logits is None else module.sink_logits.to(work)
            for k in range(layout.cp):
                if k:
                    K, V = ring_pass(ctx, [K, V])
                held = own_keys(layout, case.src_len, peer(layout, ctx.rank, ring_source(layout, c, k)))  # (s,)
                block = attend(case, Q.to(work), per_query_head(K, heads, kv, cfg.group_size).to(work),
                               per_query_head(V, heads, kv, cfg.group_size).to(work), heads, rows, held, None)
                scores[..., torch.from_numpy(held)] = block["scores"].to(Q.dtype)
                out, lse = self.merge(out, lse, block["head_outputs"], block["lse"])
                step_out, step_lse = with_sinks(out, lse, sinks)
                stages[ring_stage("out", k)], stages[ring_stage("lse", k)] = step_out.to(Q.dtype), step_lse.to(Q.dtype)
            stages["scores"] = scores
            last = layout.cp - 1
            stages["head_outputs"], stages["lse"] = stages[ring_stage("out", last)], stages[ring_stage("lse", last)]
            stages["concat"] = merge_heads(stages["head_outputs"])  # (B, t, H·D_v)
            stages["output"] = module.out_proj(stages["concat"])  # (B, t, d_out): W^O whole, b_o once
        return numpy_stages(stages)


def trade_rows_for_heads(ctx: RankContext, x: torch.Tensor, heads: int) -> torch.Tensor:
    """x (B, t, n·D), the rank's rows of n = ``heads`` heads -> (B, n/cp, T, D): every row of the rank's
    share of the heads (``all_to_all_single``; contiguous chunks, so the rows arrive in order)."""
    cp = ctx.layout.cp
    B, t, F = x.shape
    D = F // heads
    send = x.view(B, t, cp, heads // cp, D).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, t, n/cp, D)
    got = torch.empty_like(send)  # (cp, B, t, n/cp, D): got[c'] = rank c''s rows of this rank's share
    dist.all_to_all_single(got, send, group=ctx.group)
    return got.permute(1, 3, 0, 2, 4).reshape(B, heads // cp, cp * t, D)


def trade_heads_for_rows(ctx: RankContext, x: torch.Tensor) -> torch.Tensor:
    """x (B, n/cp, T, E), every row of the rank's share of the heads -> (B, n, t, E): every head of its rows."""
    cp = ctx.layout.cp
    B, share, T, E = x.shape
    send = x.view(B, share, cp, T // cp, E).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, n/cp, t, E)
    got = torch.empty_like(send)  # got[c'] = rank c''s heads share of this rank's rows
    dist.all_to_all_single(got, send, group=ctx.group)
    return got.permute(1, 0, 2, 3, 4).reshape(B, cp * share, T // cp, E)


class TorchUlysses(_TorchRanks):
    """``torch-ulysses``: Ulysses over cp = world ranks, ``all_to_all_single`` there and back."""

    name = "torch-ulysses"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world, strategy="ulysses")

    def collectives(self, world: int) -> dict[str, int]:
        """Per rank and forward: queries, keys and values traded for heads, the head outputs traded back."""
        return {"all_to_all": 4}

    def run_rank(self, ctx: RankContext, case: Case) -> dict[str, np.ndarray]:
        cfg, layout = case.config, ctx.layout
        heads = attention_heads(layout, cfg, ctx.rank)  # the rank's share of the H heads
        rows, keys = own_rows(layout, case.tgt_len, ctx.rank), own_keys(layout, case.src_len, ctx.rank)
        module = module_for(case)
        with torch.no_grad():
            stages = own_projections(case, module, rows, keys)
            k, v = stages.get("k_rot", stages["k_proj"]), stages["v_proj"]  # (B, s, H_kv·D)
            group = cfg.group_size
            kv_heads, kv = cfg.H_kv, (heads[0] // group, (heads[1] - 1) // group + 1)  # the share's kv heads
            if cfg.H_kv % layout.cp:  # key/value heads do not split over the ranks: read per query head first
                every = ((0, cfg.H), (0, cfg.H_kv))
                k, v = (merge_heads(per_query_head(split(x, cfg.H_kv), *every, group)) for x in (k, v))
                kv_heads, group, kv = cfg.H, 1, heads
            Q = trade_rows_for_heads(ctx, stages.get("q_rot", stages["q_proj"]), cfg.H)  # (B, H/cp, T, D_k)
            K = per_query_head(trade_rows_for_heads(ctx, k, kv_heads), heads, kv, group)  # (B, H/cp, S, D_k)
            V = per_query_head(trade_rows_for_heads(ctx, v, kv_heads), heads, kv, group)  # (B, H/cp, S, D_v)
            sinks = None if module.sink_logits is None else module.sink_logits[heads[0]:heads[1]]
            every_row = attention_rows(layout, case.tgt_len, ctx.rank)
            stages.update(attend(case, Q, K, V, heads, every_row, np.arange(case.src_len), sinks))
            stages["concat"] = merge_heads(trade_heads_for_rows(ctx, stages["head_outputs"]))  # (B, t, H·D_v)
            stages["output"] = module.out_proj(stages["concat"])  # (B, t, d_out)
        return numpy_stages(stages)


class TorchRingZigzag(TorchRing):
    """``torch-ring-zigzag``: :class:`TorchRing` with zigzag chunks."""

    def __init__(self) -> None:
        super().__init__("zigzag")
