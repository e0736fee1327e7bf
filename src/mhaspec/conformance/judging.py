"""What the judging side keeps about golden cases while it judges them (none of it is golden data).

A :class:`~mhaspec.fixtures.GoldenCase` is data: the spec, inputs, weights, golden stages and
the fast reference's own error bound.  What judging derives from it and keeps lives here:

* :func:`derived` — the tolerance bounds of a fixture read from a file, kept for the process in
  :data:`DERIVED` (least recently used first out, within :data:`DERIVED_BUDGET`), keyed by the
  file's verified SHA-256, the case's spec and what was derived;
* :func:`memoised`, :func:`whole_shape` and :func:`judges_key_stages` — while a large case is
  judged one block of query rows at a time (:mod:`mhaspec.conformance.blocks`), what the blocks of
  one batch entry share, the shape of the whole case, and whether this block is the one that judges
  the entry's key and value projections; :func:`judging_block` declares a block for the time it is
  judged;
* :func:`with_reference_error` — bounds widened by the golden's own error bound.

A forked process (a worker) starts with none of it: everything kept here is dropped in the child
at fork, so that an adapter never finds what was derived from the golden stages.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..fixtures import GoldenCase


class DerivedMemo:
    """What is derived from verified fixtures alone (their tolerance bounds), kept for the process:
    least recently used first out, at most ``budget`` bytes of arrays.  A value larger than the
    budget is returned and not kept.  Each array kept is made read-only, so that no caller can
    change what the next one gets."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit[0]
        value = compute()
        size = _freeze(value)
        with self._lock:
            if size <= self.budget and key not in self._items:
                self._items[key] = (value, size)
                self._bytes += size
                while self._bytes > self.budget:
                    _, (_, dropped) = self._items.popitem(last=False)
                    self._bytes -= dropped
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def forget_after_fork(self) -> None:
        """Drop everything without taking the lock (in a forked child, another thread of the parent
        may have held it at the fork)."""
        self._lock = threading.Lock()
        self._items = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes


def _freeze(value: Any) -> int:
    """Make every array in ``value`` (nested dicts, tuples, lists) read-only; their bytes."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
        return value.nbytes
    if isinstance(value, Mapping):
        return sum(_freeze(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_freeze(v) for v in value)
    return 0


#: Bytes of derived arrays kept per process (:func:`derived`): the bounds of the whole shipped
#: catalog in every dtype, forward and backward, under both precision contracts take 48 MB (the
#: proofs' 588 bounds, 55 MB).  A single run, which never asks twice, holds at most this much more.
DERIVED_BUDGET = 64 << 20
DERIVED = DerivedMemo(DERIVED_BUDGET)


def derived(golden: GoldenCase, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, a function of ``golden`` alone (its tolerance bounds in one dtype and
    precision: ``key`` names which), computed once per process for a case read from a file.

    Kept in :data:`DERIVED` under the file's verified SHA-256, the case's spec and ``key``:
    every new runner of the process (each ``mhaspec.check``, each test) that judges the same
    fixture in the same dtype finds it there.  A case not read from a file (computed on the fly,
    or one block of a case) is computed every time.  The arrays kept are read-only."""
    if golden.sha256 is None:
        return compute()
    return DERIVED.get((golden.sha256, golden.spec.model_dump_json(), key), compute)


class _Block:
    """What judging keeps about one block of query rows while it is judged."""

    __slots__ = ("golden", "memo", "whole_shape", "key_stages")

    def __init__(self, golden: GoldenCase, memo: dict[Any, Any] | None, whole_shape: tuple[int, int, int, int],
                 key_stages: bool = True):
        self.golden = golden  # held, so that its id() names no other object while it is declared
        self.memo = memo
        self.whole_shape = whole_shape
        self.key_stages = key_stages


#: The blocks being judged now, by id() of their GoldenCase (:func:`judging_block`).
_BLOCKS: dict[int, _Block] = {}


@contextmanager
def judging_block(block: GoldenCase, whole: GoldenCase, memo: dict[Any, Any] | None,
                  key_stages: bool = True) -> Iterator[GoldenCase]:
    """While the ``with`` lasts, ``block`` (rows of ``whole``) is judged as one block of ``whole``:
    :func:`whole_shape` gives the whole case's shape and :func:`memoised` keeps its values in
    ``memo`` (what the blocks of one batch entry share; None: nothing is kept).  ``key_stages``:
    whether this block judges the batch entry's key and value projections (the stages without
    query rows, the same in every block: judged in one block of the entry, :func:`judges_key_stages`)."""
    key = id(block)
    if key in _BLOCKS:
        raise RuntimeError(f"case {block.id}: this block is already being judged")
    _BLOCKS[key] = _Block(block, memo, whole_shape(whole), key_stages)
    try:
        yield block
    finally:
        del _BLOCKS[key]


def _block(golden: GoldenCase) -> _Block | None:
    entry = _BLOCKS.get(id(golden))
    return entry if entry is not None and entry.golden is golden else None


def memoised(golden: GoldenCase, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, computed once for every block of query rows of a batch entry when ``golden``
    is such a block (the keys' and values' side of the bounds: the same in every block), every
    time otherwise.  The memo lives while one adapter result is judged, so what ``compute`` reads
    of that result is the same in every block."""
    entry = _block(golden)
    if entry is None or entry.memo is None:
        return compute()
    if key not in entry.memo:
        entry.memo[key] = compute()
    return entry.memo[key]


def judges_key_stages(golden: GoldenCase) -> bool:
    """Whether judging ``golden`` judges its key and value projections (``k_proj``, ``v_proj``): True
    but for a block of query rows declared with ``key_stages=False`` (:func:`judging_block`), whose
    batch entry's projections another block judges — the same arrays against the same golden, so
    that block's verdict is theirs (:mod:`mhaspec.conformance.blocks` keeps only it)."""
    entry = _block(golden)
    return entry is None or entry.key_stages


def whole_shape(golden: GoldenCase) -> tuple[int, int, int, int]:
    """(B, H, T, S) of the whole case ``golden`` is a block of (its own shape when it is whole)."""
    entry = _block(golden)
    return entry.whole_shape if entry is not None else golden.visible.shape


def with_reference_error(golden: GoldenCase, bounds: Mapping[str, Any]) -> dict[str, Any]:
    """``bounds`` widened by the golden's own error bound (unchanged for an exact fixture).

    A stage missing from the reference error is exact (an exact fixture's ``lse``, computed at load, may
    be the only one it names).  The reference error is a worst-case bound, not rounding noise: a bound with a
    worst-case part (``worst``, see :class:`mhaspec.conformance.tolerance.Bound`) gets it
    there; a plain tolerance array gets it added."""
    if golden.reference_error is None:
        return dict(bounds)
    out = {}
    for stage, bound in bounds.items():
        extra = golden.reference_error.get(stage, 0.0)  # a stage it does not name is exact
        if isinstance(extra, float) and extra == 0.0:  # proven exact (the scores, mostly): unchanged
            out[stage] = bound
        else:
            out[stage] = bound._replace(worst=bound.worst + extra) if hasattr(bound, "_replace") else bound + extra
    return out


def _forget_in_forked_child() -> None:
    DERIVED.forget_after_fork()
    _BLOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)

