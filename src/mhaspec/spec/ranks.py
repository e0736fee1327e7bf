"""Sharded attention: which slice of a case each rank owns (docs/distributed.md).

A distributed adapter implements one rank: ``run_rank(ctx, case)``.  Every rank receives the whole
case and returns the stages of its own slice; this module says what that slice is, from the
adapter's :class:`Layout` and the rank number alone.  Pure numpy, no framework.

Ranks and coordinates
    world = tp · cp.  Rank r has mesh coordinates ``tp = r % tp`` (its tensor-parallel index) and
    ``cp = r // tp`` (its context-parallel index): the ranks of one sequence chunk are neighbours.

Heads (tensor parallelism, tp > 1)
    tp index t owns query heads [t·H/tp, (t+1)·H/tp) (H % tp == 0) and the key/value heads those
    heads read (query head h reads key/value head h // (H / H_kv)): with H_kv ≥ tp that is
    [t·H_kv/tp, (t+1)·H_kv/tp); with H_kv < tp (``kv_heads = "replicate"``) one key/value head,
    replicated on tp / H_kv ranks.  An adapter that cannot replicate declares
    ``kv_heads = "unsupported"`` and such a case is reported unsupported for it.

Rows and keys (context parallelism, cp > 1)
    The query rows [0, T) and the keys [0, S) are each cut into chunks.  ``contiguous``: cp equal
    chunks, rank c owns chunk c.  ``zigzag``: 2·cp equal chunks, rank c owns chunks c and 2cp − 1 − c
    (the load balance of causal rings).  A rank's rows are its chunks in increasing position order.
    Positions are always global: the causal diagonal, windows, ALiBi distances and RoPE angles of a
    rank's rows are those of the full case.

Strategies (how cp ranks see keys they do not own)
    ``ring``: at step k = 0 … cp − 1 rank c holds the key/value chunk(s) of rank (c − k) mod cp
    (:func:`ring_source`) and merges it into its running output by the log-sum-exp.
    ``ulysses``: an all-to-all trades rows for heads: for attention, rank c holds every row of its
    tp heads' c-th cp-share, then trades back.  ``allgather``: every rank gathers all keys and values.

The stages of a rank (each is a stage of the spec's forward pass of the case, sliced; nothing else):

* ``q_proj``, ``q_rot``: the rank's rows × the columns of its tp heads;
* ``k_proj``, ``v_proj``, ``k_rot``: the rank's key rows × the columns of its tp key/value heads;
* ``scores``, ``attn_weights``, ``head_outputs``, ``lse``: the rank's *attention* heads × its *attention*
  rows (:func:`attention_heads`, :func:`attention_rows`) × every key — what the rank attends with;
* ``ring_out[k]``, ``ring_lse[k]`` (ring only, k = 0 … cp − 1): ``head_outputs`` and ``lse`` of the case
  whose visibility is ANDed with "key j is in a chunk the rank has held by step k" (the attention over
  the keys seen so far, with global offsets; a row that has seen no visible key yet: 0 and −inf, the
  spec's rule for a row that sees no key; sinks as in the spec); ``ring_out[cp−1]`` = ``head_outputs``;
* ``concat``: the rank's rows × the columns of its tp heads;
* ``o_partial`` (tp > 1): concat's columns of the rank's tp heads times the rows of W^O of those heads,
  **without** b_o — the rank's W^O product before the reduction;
* ``output``: the rank's rows, reduced (Σ over the tp ranks of o_partial, plus b_o once).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from .stages import STAGE

if TYPE_CHECKING:
    from .config import MHAConfig

Strategy = Literal["ring", "ulysses", "allgather"]
Partition = Literal["contiguous", "zigzag"]
KvHeads = Literal["replicate", "unsupported"]

STRATEGIES: tuple[str, ...] = ("ring", "ulysses", "allgather")
PARTITIONS: tuple[str, ...] = ("contiguous", "zigzag")

#: The stages a rank may return besides the spec's forward stages: ``o_partial`` and the ring steps.
RANK_STAGES: tuple[str, ...] = ("o_partial",)
_RING = re.compile(r"^ring_(out|lse)\[(\d+)\]$")


class Coords(NamedTuple):
    """A rank's mesh coordinates: its tensor-parallel index ``tp`` and context-parallel index ``cp``."""

    tp: int
    cp: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an adapter shards a case over world = tp · cp ranks (module docstring)."""

    tp: int = 1
    cp: int = 1
    strategy: Strategy = "ring"
    partition: Partition = "contiguous"
    kv_heads: KvHeads = "replicate"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.cp < 1:
            raise ValueError(f"layout: tp and cp are >= 1, got tp = {self.tp}, cp = {self.cp}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"layout: strategy is one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.partition not in PARTITIONS:
            raise ValueError(f"layout: partition is one of {', '.join(PARTITIONS)}, got {self.partition!r}")
        if self.kv_heads not in ("replicate", "unsupported"):
            raise ValueError(f"layout: kv_heads is replicate or unsupported, got {self.kv_heads!r}")

    @property
    def world(self) -> int:
        return self.tp * self.cp

    def coords(self, rank: int) -> Coords:
        """Rank ``rank``'s mesh coordinates (tp = rank % tp, cp = rank // tp)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in [0, {self.world})")
        return Coords(rank % self.tp, rank // self.tp)

    def describe(self) -> str:
        """``tp 2`` · ``cp 4 (ring, zigzag)`` · ``tp 2 × cp 2 (ulysses, contiguous)``."""
        parts = [f"tp {self.tp}"] if self.tp > 1 else []
        if self.cp > 1:
            parts.append(f"cp {self.cp} ({self.strategy}, {self.partition})")
        return " × ".join(parts) or "world 1"

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def problem(self, config: MHAConfig, tgt_len: int, src_len: int) -> str | None:
        """Why a case of ``config``, T = ``tgt_len``, S = ``src_len`` cannot be sharded this way (one line), or
        None.  An unsupported H_kv < tp (``kv_heads = "unsupported"``) is a problem too."""
        H, H_kv = config.H, config.H_kv
        if H % self.tp:
            return f"H = {H} heads do not split over tp = {self.tp} ranks"
        if H_kv % self.tp and self.tp % H_kv:
            return f"H_kv = {H_kv} key/value heads neither split over nor replicate onto tp = {self.tp} ranks"
        if H_kv < self.tp and self.kv_heads == "unsupported":
            return f"H_kv = {H_kv} < tp = {self.tp}: the adapter declares kv_heads = \"unsupported\" (no replication)"
        pieces = self.cp * (2 if self.partition == "zigzag" else 1)
        if self.cp > 1:
            for name, n in (("T", tgt_len), ("S", src_len)):
                if n % pieces:
                    return f"{name} = {n} does not cut into {pieces} equal {self.partition} chunks for cp = {self.cp}"
            if self.strategy == "ulysses" and (H // self.tp) % self.cp:
                return f"ulysses: the {H // self.tp} heads of a tp rank do not split over cp = {self.cp} ranks"
        return None


def head_range(layout: Layout, config: MHAConfig, rank: int) -> tuple[int, int]:
    """Query heads [h0, h1) of rank ``rank``'s tp index."""
    t, per = layout.coords(rank).tp, config.H // layout.tp
    return t * per, (t + 1) * per


def kv_head_range(layout: Layout, config: MHAConfig, rank: int) -> tuple[int, int]:
    """Key/value heads [g0, g1) that the rank's query heads read (one, replicated, when H_kv < tp)."""
    h0, h1 = head_range(layout, config, rank)
    group = config.group_size
    return h0 // group, (h1 - 1) // group + 1


def attention_heads(layout: Layout, config: MHAConfig, rank: int) -> tuple[int, int]:
    """Query heads [h0, h1) the rank attends with: its tp heads, or (ulysses) their cp-th share."""
    h0, h1 = head_range(layout, config, rank)
    if layout.cp > 1 and layout.strategy == "ulysses":
        c, per = layout.coords(rank).cp, (h1 - h0) // layout.cp
        return h0 + c * per, h0 + (c + 1) * per
    return h0, h1


def chunks(n: int, layout: Layout, c: int) -> list[tuple[int, int]]:
    """Positions [start, end) of [0, ``n``) owned by cp index ``c``, in increasing order."""
    if layout.cp == 1:
        return [(0, n)]
    if layout.partition == "contiguous":
        size = n // layout.cp
        return [(c * size, (c + 1) * size)]
    size = n // (2 * layout.cp)
    return [(c * size, (c + 1) * size), ((2 * layout.cp - 1 - c) * size, (2 * layout.cp - c) * size)]


def _indices(spans: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in spans]) if spans else np.zeros(0, dtype=np.intp)


def own_rows(layout: Layout, tgt_len: int, rank: int) -> np.ndarray:
    """The query rows the rank owns (its chunks of [0, T)), increasing."""
    return _indices(chunks(tgt_len, layout, layout.coords(rank).cp))


def own_keys(layout: Layout, src_len: int, rank: int) -> np.ndarray:
    """The key rows the rank owns (its chunks of [0, S)), increasing."""
    return _indices(chunks(src_len, layout, layout.coords(rank).cp))


def attention_rows(layout: Layout, tgt_len: int, rank: int) -> np.ndarray:
    """The query rows the rank attends for: every row under ulysses, else its own."""
    if layout.cp > 1 and layout.strategy == "ulysses":
        return np.arange(tgt_len)
    return own_rows(layout, tgt_len, rank)


def ring_source(layout: Layout, c: int, k: int) -> int:
    """The cp index whose key/value chunk(s) cp rank ``c`` holds at ring step ``k``: (c − k) mod cp."""
    return (c - k) % layout.cp


def seen_keys_at(layout: Layout, src_len: int, rank: int, k: int) -> np.ndarray:
    """(S,) bool: the keys the rank has held by ring step ``k`` (its own chunk at step 0)."""
    seen = np.zeros(src_len, dtype=bool)
    c = layout.coords(rank).cp
    for step in range(k + 1):
        for a, b in chunks(src_len, layout, ring_source(layout, c, step)):
            seen[a:b] = True
    return seen


def ring_stage(kind: str, k: int) -> str:
    """``ring_out[k]`` or ``ring_lse[k]``."""
    return f"ring_{kind}[{k}]"


def parse_ring_stage(name: str) -> tuple[str, int] | None:
    """(``"out"`` | ``"lse"``, k) for ``ring_out[k]`` / ``ring_lse[k]``; None for any other name."""
    m = _RING.match(name)
    return None if m is None else (m.group(1), int(m.group(2)))


def rank_stage_names(layout: Layout, forward: tuple[str, ...]) -> tuple[str, ...]:
    """The stages a rank of ``layout`` may return, in pipeline order: ``forward`` (the case's forward
    stages) with ``o_partial`` after ``concat`` (tp > 1) and the ring steps after ``head_outputs`` (ring)."""
    names: list[str] = []
    for s in forward:
        names.append(s)
        if s == STAGE.head_outputs and layout.cp > 1 and layout.strategy == "ring":
            names += [ring_stage(kind, k) for k in range(layout.cp) for kind in ("out", STAGE.lse)]
        if s == STAGE.concat and layout.tp > 1:
            names.append("o_partial")
    return tuple(names)
