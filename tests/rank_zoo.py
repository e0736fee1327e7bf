"""The kill list of issue 33: the numpy distributed adapters, each with one known bug of sharded attention.

Each entry is a subclass of a correct adapter of :mod:`mhaspec.adapters.numpy_ranks` that overrides the one
method where the bug lives, with the catalog cases that reach it (:data:`REACH`: a causal case for the
offsets, GQA with H_kv < tp for the replication, ...).  The proofs (tests/test_rank_proofs.py) and
benchmarks/rank_figures.py run them on the threads launcher in every dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mhaspec.adapters.numpy_ranks import (Heads, NumpyRing, NumpyRingZigzag, NumpyTP, NumpyUlysses, columns,
                                          merge_lse, precision, project)
from mhaspec.spec import Case, masks
from mhaspec.spec.ranks import chunks, ring_source


class BiasOnEveryRank(NumpyTP):
    """b_o added by every rank's row-parallel W^O, then all-reduced: the output is off by (tp − 1)·b_o
    (text-generation-inference #1036, nano-vllm #99)."""

    name = "bug-bias-on-every-rank"

    def output(self, ctx: Any, case: Case, concat: np.ndarray, heads: Heads) -> dict[str, np.ndarray]:
        w, (dt, acc) = case.weights, precision(case.dtype)
        partial = project(concat, w.w_o[columns(heads, case.config.D_v)], w.b_o, dt, acc)  # b_o on every rank
        return {"o_partial": partial, "output": self.reduce(ctx, partial)}


class MissingAllReduce(NumpyTP):
    """The row-parallel W^O's partial sums never reduced: each rank's output is its own heads' share."""

    name = "bug-missing-all-reduce"

    def reduce(self, ctx: Any, partial: np.ndarray) -> np.ndarray:
        return partial


class DuplicatedAllReduce(NumpyTP):
    """The partial sums all-reduced twice (once in the layer, once by its caller): tp times the sum."""

    name = "bug-duplicated-all-reduce"

    def reduce(self, ctx: Any, partial: np.ndarray) -> np.ndarray:
        return super().reduce(ctx, super().reduce(ctx, partial))


class KvHeadsSliced(NumpyTP):
    """H_kv < tp: the key/value heads dealt round-robin (rank t takes head t mod H_kv) instead of the one
    its query heads read, replicated (Megatron-LM #3575's silently wrong result)."""

    name = "bug-kv-heads-sliced"

    def own(self, ctx: Any, case: Case) -> tuple[np.ndarray, np.ndarray, Heads, Heads]:
        rows, keys, heads, kv = super().own(ctx, case)
        H_kv, tp = case.config.H_kv, ctx.layout.tp
        if H_kv < tp:
            g = ctx.coords.tp % H_kv
            kv = (g, g + 1)
        return rows, keys, heads, kv


class LocalCausalOffsets(NumpyRing):
    """The causal (and window) band of each ring step drawn as if the rank's rows and the held chunk were the
    whole sequence: local positions instead of global ones (ring-flash-attention #54)."""

    name = "bug-local-causal-offsets"

    def step_visibility(self, ctx: Any, case: Case, visible: np.ndarray, heads: Heads, rows: np.ndarray,
                        keys: np.ndarray) -> np.ndarray:
        band = masks.visibility(case.config, None, case.batch, len(rows), len(keys))[:, heads[0]:heads[1]]
        explicit = case.inputs.mask
        if explicit is not None:
            band = band & np.broadcast_to(explicit, (case.batch, 1, case.tgt_len, case.src_len))[:, :, rows][..., keys]
        return band


class LseAdded(NumpyRing):
    """Ring steps merged by adding their log-sum-exps (lse + lse_k) where log(e^lse + e^lse_k) is needed
    (ring-flash-attention #20); the outputs rescaled by that wrong total."""

    name = "bug-lse-added"

    def merge(self, out: np.ndarray, lse: np.ndarray, out_k: np.ndarray, lse_k: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
        if not np.isfinite(lse).any():  # nothing merged yet: take the chunk as it is
            return merge_lse(out, lse, out_k, lse_k)
        added = np.where(np.isfinite(lse), lse, 0) + np.where(np.isfinite(lse_k), lse_k, 0)
        added = np.where(np.isfinite(lse) | np.isfinite(lse_k), added, -np.inf)
        share = lambda x: np.where(np.isfinite(x), np.exp(np.where(np.isfinite(x), x, 0) - np.where(  # noqa: E731
            np.isfinite(added), added, 0)), 0)[..., None]
        return out * share(lse) + out_k * share(lse_k), added


class ZigzagWrongOrder(NumpyRingZigzag):
    """The zigzag chunks of a rank taken late one first (2cp − 1 − c, then c), for its rows and for the key
    chunks it holds: consistent attention, but every stage's rows out of the partition's order."""

    name = "bug-zigzag-wrong-order"

    @staticmethod
    def swapped(n: int, layout: Any, c: int) -> np.ndarray:
        return np.concatenate([np.arange(a, b) for a, b in reversed(chunks(n, layout, c))])

    def own(self, ctx: Any, case: Case) -> tuple[np.ndarray, np.ndarray, Heads, Heads]:
        _, _, heads, kv = super().own(ctx, case)
        c = ctx.coords.cp
        return self.swapped(case.tgt_len, ctx.layout, c), self.swapped(case.src_len, ctx.layout, c), heads, kv

    def held_keys(self, ctx: Any, case: Case, step: int) -> np.ndarray:
        return self.swapped(case.src_len, ctx.layout, ring_source(ctx.layout, ctx.coords.cp, step))


class RingWrongSource(NumpyRing):
    """The chunk held at step k taken to be rank (c + k) mod cp's instead of (c − k) mod cp's (the ring
    turned the other way): its keys attended at the wrong positions.  The same ring at cp = 2."""

    name = "bug-ring-wrong-source"

    def held_keys(self, ctx: Any, case: Case, step: int) -> np.ndarray:
        layout = ctx.layout
        source = (ctx.coords.cp + step) % layout.cp
        return np.concatenate([np.arange(a, b) for a, b in chunks(case.src_len, layout, source)])


class UlyssesSharesReversed(NumpyUlysses):
    """The head shares coming back from Ulysses' second all_to_all concatenated in reverse peer order:
    each rank's concat has its heads' columns in the wrong places."""

    name = "bug-ulysses-shares-reversed"

    def heads_to_rows(self, ctx: Any, concat: np.ndarray, rows: list[np.ndarray], peers: list[int]) -> np.ndarray:
        back = self.all_to_all(ctx, [concat[:, r] for r in rows], peers)
        return np.concatenate(back[::-1], axis=-1)  # the peers' shares, last first


#: Every bug, with the catalog cases that reach it (the proofs run these, at world 2 and 4 where they shard).
REACH: dict[type, tuple[str, ...]] = {
    BiasOnEveryRank: ("gqa", "bloom_alibi"),
    MissingAllReduce: ("gqa", "bloom_alibi"),
    DuplicatedAllReduce: ("gqa", "bloom_alibi"),
    KvHeadsSliced: ("gqa", "gemma2_softcap_window"),
    LocalCausalOffsets: ("bloom_alibi", "gpt_oss_sinks_window"),
    LseAdded: ("bloom_alibi", "gpt_oss_sinks_window"),
    ZigzagWrongOrder: ("bloom_alibi",),
    RingWrongSource: ("bloom_alibi",),
    UlyssesSharesReversed: ("bloom_alibi", "gpt_oss_sinks_window"),
}


def run_ranks(adapter: Any, world: int, case_ids: tuple[str, ...], dtypes: tuple[str, ...] = ("float64",)
              ) -> dict[tuple[str, str], list]:
    """{(case id, dtype): the RankReply of every rank} of ``adapter`` (an object: the worker inherits it) at
    ``world`` on the threads launcher, for the catalog cases of ``case_ids`` its layout shards."""
    from mhaspec.protocol.transports.threads_ranks import ThreadsLauncher

    from tests.rank_oracle import shardable

    launcher = ThreadsLauncher()
    try:
        launcher.start(adapter, world)
        layout = adapter.layout(world)
        return {(spec.id, dtype): launcher.run(spec.case(dtype), timeout=120)
                for spec in shardable(layout, ids=case_ids) for dtype in dtypes}
    finally:
        launcher.close()


#: The correct numpy distributed adapters (built-in names) the proofs hold against the kill list.
CORRECT = ("numpy-tp", "numpy-ring", "numpy-ring-zigzag", "numpy-ulysses", "numpy-allgather")
DTYPES = ("float64", "float32", "float16", "bfloat16")
#: a change of the float64 result larger than the sharding's own (≤ 1e-12: tests/test_numpy_ranks.py)
CHANGED = 1e-9


def float64_changes(bug: type, world: int) -> dict[str, dict[int, tuple[str, int | None]]]:
    """{case: {rank: (the first stage the bug changes, the first ring step it changes or None)}} against
    each rank's exact golden, in float64, for the cases of :data:`REACH` at ``world`` (tolerance-free)."""
    from mhaspec.spec.ranks import parse_ring_stage

    from tests.rank_oracle import first_differences, golden_ranks, relative_error

    layout = bug().layout(world)
    out = {}
    for (case, _), replies in run_ranks(bug(), world, REACH[bug]).items():
        if any(r.error for r in replies):
            raise AssertionError(f"{bug.name} world {world} {case}: {[r.error for r in replies]}")
        want = golden_ranks(case, layout)
        first = first_differences([r.stages for r in replies], case, layout, CHANGED)
        steps = {r.rank: sorted(parse_ring_stage(s)[1] for s in want[r.rank] if parse_ring_stage(s)
                                and relative_error(r.stages[s], want[r.rank][s]) > CHANGED) for r in replies}
        out[case] = {r: (stage, steps[r][0] if steps[r] else None) for r, stage in first.items()}
    return out


def judged(adapter: Any, world: int, cases: tuple[str, ...], dtypes: tuple[str, ...] = DTYPES) -> list:
    """The CaseResults of ``adapter`` (a built-in name or an object) at ``world`` on the catalog ``cases`` its
    layout shards, judged rank by rank (mhaspec.conformance.check, the threads launcher)."""
    from mhaspec.conformance import check

    from tests.rank_oracle import shardable

    layout = (load(adapter) if isinstance(adapter, str) else adapter).layout(world)
    ids = [s.id for s in shardable(layout, ids=cases)]
    if not ids:
        return []
    return check(adapter, dtypes=list(dtypes), cases=ids, world=world, timeout=300).results


def load(name: str) -> Any:
    from mhaspec.adapters import load_adapter

    return load_adapter(name)


def correct_cases(name: str, world: int) -> tuple[str, ...]:
    """Every catalog case the correct adapter ``name`` shards at ``world``."""
    from tests.rank_oracle import shardable

    return tuple(s.id for s in shardable(load(name).layout(world)))
