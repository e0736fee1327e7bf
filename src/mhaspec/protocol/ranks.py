"""The distributed adapter contract: one rank of a sharded implementation (docs/distributed.md).

A distributed adapter is an adapter (``name``, optional ``dtypes``, ``variants``, ``known_deviations``,
``supports``) with, instead of ``run(case)``:

* ``layout(world) -> Layout`` — how it shards at world size ``world`` (:class:`mhaspec.spec.ranks.Layout`:
  tp, cp, ring | ulysses | allgather, contiguous | zigzag, kv_heads replicate | unsupported);
* ``launcher`` — ``"threads"`` (numpy, collectives of :class:`Comm` in one process), ``"torch"``
  (torch.distributed, gloo: one process per rank) or ``"jax"`` (one process, ``world`` host devices, a
  ``jax.sharding.Mesh``);
* ``run_rank(ctx, case) -> Mapping[str, ArrayLike]`` — the stages of rank ``ctx.rank`` (docs/distributed.md;
  :mod:`mhaspec.spec.ranks` says which slice each is).  Every rank receives the whole case.  The jax
  launcher calls it once per rank, in rank order, in one process: an SPMD program may compute every
  device's values at rank 0's call and hand out the slices (``ctx.rank``) from a cache;
* optional ``collectives(world) -> Mapping[str, int] | None`` — the collectives the layout promises per
  forward call, by kind (``all_reduce``, ``all_gather``, ``all_to_all``, ``send_recv``, …): the suite
  compares them with the ones the ranks issued, where the launcher can count them.

Adapters import this module and :mod:`mhaspec.spec`; the judging side imports it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ..spec import Case
from ..spec.ranks import Coords, Layout

Launcher = Literal["threads", "torch", "jax"]
LAUNCHERS: tuple[str, ...] = ("threads", "torch", "jax")


@dataclass
class RankContext:
    """What ``run_rank`` knows about its place: ``rank``, ``world``, ``layout``, ``coords`` (tp, cp), and the
    launcher's handle — ``group`` (torch.distributed's default process group), ``mesh`` (a jax Mesh with
    axes ``("tp", "cp")``) or ``comm`` (:class:`Comm`, the threads launcher)."""

    rank: int
    world: int
    layout: Layout
    group: Any = None
    mesh: Any = None
    comm: Any = None
    #: Collectives the launcher saw this rank issue, by kind (filled by the launcher, where it can).
    issued: dict[str, int] = field(default_factory=dict)

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)


class Comm(Protocol):
    """The threads launcher's collectives over numpy arrays (every rank calls each, in the same order)."""

    def all_reduce(self, x: np.ndarray, ranks: tuple[int, ...] | None = None) -> np.ndarray: ...
    def all_gather(self, x: np.ndarray, ranks: tuple[int, ...] | None = None) -> list[np.ndarray]: ...
    def all_to_all(self, xs: list[np.ndarray], ranks: tuple[int, ...] | None = None) -> list[np.ndarray]: ...
    def send_recv(self, x: np.ndarray, to: int, source: int) -> np.ndarray: ...


@runtime_checkable
class DistributedAdapter(Protocol):
    name: str
    launcher: str

    def layout(self, world: int) -> Layout: ...

    def run_rank(self, ctx: RankContext, case: Case) -> Mapping[str, Any]: ...


def is_distributed(adapter: object) -> bool:
    """Whether ``adapter`` implements one rank (``run_rank``) rather than the whole layer."""
    return callable(getattr(adapter, "run_rank", None))


class RankReply(NamedTuple):
    """What a launcher brings back from one rank for one case: its stages (float64 canonical arrays as
    returned, or None), an error (one line naming the rank: an exception, a signal, a timeout) and the
    collectives it issued (None where the launcher cannot count them)."""

    rank: int
    stages: dict[str, np.ndarray] | None
    error: str | None = None
    issued: dict[str, int] | None = None


class RankLauncher(Protocol):
    """Starts ``world`` ranks of an adapter once, then runs cases on them (conformance/ranks.py)."""

    def start(self, adapter: str, world: int) -> dict[str, Any]:
        """Load the adapter in every rank; return its description (name, layout as a dict, dtypes, …)."""
        ...

    def run(self, case: Case, timeout: float) -> list[RankReply]:
        """Run ``case`` on every rank; one reply per rank, in rank order.  A rank that crashes or hangs
        gives an error reply; the launcher then restarts its ranks before the next case and leaves no
        process behind."""
        ...

    def close(self) -> None: ...
