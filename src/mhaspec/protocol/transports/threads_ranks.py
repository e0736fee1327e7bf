"""The threads launcher: the ``world`` ranks of a distributed adapter as threads of ONE worker process.

For adapters whose ``launcher`` is ``"threads"`` (numpy: :mod:`mhaspec.adapters.numpy_ranks`).  The
adapter never runs in the runner's process: :class:`ThreadsLauncher` starts the same worker process as
any Python adapter (:class:`~.process.Worker`: forked or spawned, loaded by name or inherited), and the
worker, seeing an adapter with ``run_rank``, serves ranks (:func:`serve_ranks`) instead of ``run``.

Per case the runner sends one request ``{"op": "ranks", "world", "timeout", "case"}`` (the case as in
``mhaspec-wire/1``: safetensors bytes, never a pickle); the worker runs ``run_rank(ctx, case)`` on
``world`` threads, each with a :class:`ThreadComm` over one shared :class:`Exchange`, and answers one
reply: per rank its error (or null), the collectives it issued and its stage names, and the arrays
``"{rank}/{stage}"`` as safetensors bytes.

Collectives (:class:`ThreadComm`, the :class:`~mhaspec.protocol.ranks.Comm` of ``ctx.comm``) are
barrier-based and deterministic: every rank of a group deposits its array, the last to arrive computes
the result once (``all_reduce`` sums in rank order), and all leave with copies.  ``send_recv`` is a
buffered send and a blocking receive.  The n-th collective a rank issues on a group meets the n-th of
each peer; peers that called different kinds get an error naming both.

What can go wrong costs that case only, named by rank:

* a rank raising: that rank's error reply (``run_rank() raised …``); peers waiting for it in a
  collective get an error naming the rank that failed;
* a rank waiting on a collective a peer never calls: if the peer returned, at once (``… rank 1 returned
  without calling it``); if the peer is still busy (a hang), at the timeout, with an error naming the
  ranks still waiting and where — the worker is then replaced (threads cannot be stopped);
* a worker that does not answer at all (native code holding the GIL, a crash): killed at the timeout
  (plus :data:`GRACE`), every rank's reply names the cause; the next case gets a fresh worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import AdapterError
from ...io import safetensors
from ...spec import Case
from ...spec.ranks import Layout
from .. import wire
from ..ranks import RankContext, RankReply
from .base import AdapterCrash, CaseTimeout
from .process import Worker

#: Seconds the runner waits past the case's timeout for the worker's own report of a hang.
GRACE = 5.0

#: The request and reply kind of one case on every rank (the worker's ranks loop: :func:`serve_ranks`).
RANKS_OP = "ranks"
#: The request asking the adapter's layout, launcher and promised collectives at a world size.
LAYOUT_OP = "layout"


class RankAborted(Exception):
    """A collective that can never complete: a peer failed, returned, or the case's deadline passed."""


# -- the worker's side: collectives between threads --------------------------------------------------


class Exchange:
    """What the ranks of one case share: the slots of their collectives, mailboxes for send_recv, and
    who has finished (or failed).  One condition variable; every wait ends by the ``deadline``."""

    def __init__(self, world: int, deadline: float | None) -> None:
        self.world, self.deadline = world, deadline
        self.lock = threading.Condition()
        self.slots: dict[tuple[tuple[int, ...], int], dict[str, Any]] = {}
        self.mail: dict[tuple[int, int], list[np.ndarray]] = {}
        self.done: set[int] = set()
        self.failed: dict[int, str] = {}
        #: Where each rank waits now (``all_reduce #2 over ranks (0, 1)``), for the hang report.
        self.waiting: dict[int, str] = {}

    def finish(self, rank: int, error: str | None) -> None:
        with self.lock:
            self.done.add(rank)
            if error is not None:
                self.failed[rank] = error
            self.lock.notify_all()

    def wait(self, rank: int, where: str, ready: Callable[[], bool], peers: Callable[[], list[int]]) -> None:
        """Block rank ``rank`` (holding :attr:`lock`) until ``ready()``; :class:`RankAborted` when one of
        the ``peers()`` it still waits for failed or returned, or at the deadline."""
        self.waiting[rank] = where
        try:
            while not ready():
                gone = [p for p in peers() if p in self.done]
                if gone:
                    p = gone[0]
                    why = "failed" if p in self.failed else "returned without calling it"
                    raise RankAborted(f"{where} never completes: rank {p} {why}")
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RankAborted(f"{where}: still waiting at the timeout")
                self.lock.wait(left)
        finally:
            del self.waiting[rank]

    def collective(self, rank: int, kind: str, group: tuple[int, ...], seq: int, value: Any,
                   combine: Callable[[list[Any]], list[Any]]) -> Any:
        """Rank ``rank``'s part of the ``seq``-th collective over ``group``: deposit ``value``; the last
        to arrive computes ``combine`` (the values in group order → each member's result, in group
        order) once; return this rank's result."""
        where = f"{kind} #{seq} over ranks {group}"
        with self.lock:
            slot = self.slots.setdefault((group, seq), {"kind": kind, "values": {}, "taken": 0})
            if slot["kind"] != kind:
                raise RankAborted(f"{where}: a peer called {slot['kind']} #{seq} over the same ranks")
            slot["values"][rank] = value
            if len(slot["values"]) == len(group):
                slot["results"] = combine([slot["values"][r] for r in group])
                self.lock.notify_all()
            self.wait(rank, where, lambda: "results" in slot, lambda: [p for p in group if p not in slot["values"]])
            result = slot["results"][group.index(rank)]
            slot["taken"] += 1
            if slot["taken"] == len(group):
                del self.slots[(group, seq)]
            return result

    def send(self, source: int, to: int, x: np.ndarray) -> None:
        with self.lock:
            self.mail.setdefault((source, to), []).append(x)
            self.lock.notify_all()

    def receive(self, rank: int, source: int, where: str) -> np.ndarray:
        with self.lock:
            box = self.mail.setdefault((source, rank), [])
            self.wait(rank, where, lambda: bool(box), lambda: [source])
            return box.pop(0)


def _sum_in_rank_order(values: list[np.ndarray]) -> list[np.ndarray]:
    total = values[0].copy()
    for v in values[1:]:
        total = total + v  # in the arrays' dtype, one rounding per addition, rank order
    return [total.copy() for _ in values]


def _gathered(values: list[np.ndarray]) -> list[list[np.ndarray]]:
    return [[v.copy() for v in values] for _ in values]


def _transposed(values: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """all_to_all: member i receives [member j's piece i for j in group]."""
    return [[np.array(values[j][i], copy=True) for j in range(len(values))] for i in range(len(values))]


class ThreadComm:
    """One rank's :class:`~mhaspec.protocol.ranks.Comm` over an :class:`Exchange`; counts what it issues
    into ``issued`` (by kind)."""

    def __init__(self, exchange: Exchange, rank: int, issued: dict[str, int]) -> None:
        self.exchange, self.rank, self.issued = exchange, rank, issued
        self._seq: dict[tuple[int, ...], int] = {}

    def _group(self, kind: str, ranks: tuple[int, ...] | None) -> tuple[tuple[int, ...], int]:
        group = tuple(range(self.exchange.world)) if ranks is None else tuple(sorted(set(ranks)))
        if self.rank not in group or any(not 0 <= r < self.exchange.world for r in group):
            raise ValueError(f"rank {self.rank}: {kind} over ranks {group}, which must include it and lie in "
                             f"[0, {self.exchange.world})")
        self.issued[kind] = self.issued.get(kind, 0) + 1
        seq = self._seq[group] = self._seq.get(group, 0) + 1
        return group, seq

    def all_reduce(self, x: np.ndarray, ranks: tuple[int, ...] | None = None) -> np.ndarray:
        group, seq = self._group("all_reduce", ranks)
        return self.exchange.collective(self.rank, "all_reduce", group, seq, np.asarray(x), _sum_in_rank_order)

    def all_gather(self, x: np.ndarray, ranks: tuple[int, ...] | None = None) -> list[np.ndarray]:
        group, seq = self._group("all_gather", ranks)
        return self.exchange.collective(self.rank, "all_gather", group, seq, np.asarray(x), _gathered)

    def all_to_all(self, xs: list[np.ndarray], ranks: tuple[int, ...] | None = None) -> list[np.ndarray]:
        group, seq = self._group("all_to_all", ranks)
        if len(xs) != len(group):
            raise ValueError(f"rank {self.rank}: all_to_all over ranks {group} takes {len(group)} arrays, "
                             f"got {len(xs)}")
        return self.exchange.collective(self.rank, "all_to_all", group, seq, [np.asarray(x) for x in xs],
                                        _transposed)

    def send_recv(self, x: np.ndarray, to: int, source: int) -> np.ndarray:
        """Send ``x`` to rank ``to`` (buffered) and receive the array rank ``source`` sent this rank."""
        world = self.exchange.world
        if not (0 <= to < world and 0 <= source < world):
            raise ValueError(f"rank {self.rank}: send_recv to {to} from {source}: ranks lie in [0, {world})")
        self.issued["send_recv"] = self.issued.get("send_recv", 0) + 1
        n = self.issued["send_recv"]
        self.exchange.send(self.rank, to, np.array(x, copy=True))
        return self.exchange.receive(self.rank, source, f"send_recv #{n} (receiving from rank {source})")


def run_ranks(adapter: Any, case: Case, layout: Layout, timeout: float | None
              ) -> tuple[list[dict[str, Any]], dict[str, np.ndarray], bool]:
    """Run ``run_rank`` of every rank of ``layout`` on its own thread.  Returns (per rank ``{"error",
    "issued", "keys", "special"}``, the arrays ``"{rank}/{stage}"``, whether a thread is still stuck —
    then this process must be replaced)."""
    from ..worker import describe_exception

    world = layout.world
    deadline = None if timeout is None else time.monotonic() + timeout
    exchange = Exchange(world, deadline)
    results: list[Any] = [None] * world
    errors: list[str | None] = [None] * world
    contexts = [RankContext(rank=r, world=world, layout=layout) for r in range(world)]

    def one_rank(r: int) -> None:
        ctx = contexts[r]
        ctx.comm = ThreadComm(exchange, r, ctx.issued)
        try:
            results[r] = dict(adapter.run_rank(ctx, case))
        except RankAborted as exc:
            errors[r] = f"rank {r}: {exc}"
        except SystemExit as exc:
            errors[r] = f"rank {r}: run_rank() called sys.exit({exc.code!r})"
        except BaseException as exc:  # noqa: BLE001 - what a rank raises is its verdict
            errors[r] = f"rank {r}: run_rank() raised {describe_exception(exc)}"
        exchange.finish(r, errors[r])

    threads = [threading.Thread(target=one_rank, args=(r,), name=f"mhaspec-rank-{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.5)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        with exchange.lock:
            waiting = dict(exchange.waiting)
        for r in stuck:
            where = f"waiting in {waiting[r]}" if r in waiting else "still computing (not in a collective)"
            errors[r] = f"rank {r}: no answer within the {timeout:g} s timeout, {where}"
    described: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for r in range(world):
        entry: dict[str, Any] = {"error": errors[r], "issued": dict(contexts[r].issued), "keys": [], "special": {}}
        if errors[r] is None:
            entry["keys"], entry["special"], own = _stage_arrays(results[r])
            arrays.update({f"{r}/{name}": a for name, a in own.items()})
        described.append(entry)
    return described, arrays, bool(stuck)


def _stage_arrays(returned: Mapping[Any, Any]) -> tuple[list[str], dict[str, Any], dict[str, np.ndarray]]:
    """(the returned keys, the values that cannot travel as arrays, the arrays by name) of one rank."""
    keys, special, arrays = [], {}, {}
    for key, value in returned.items():
        if not isinstance(key, str):
            continue
        keys.append(key)
        try:
            array = np.asarray(value)
        except Exception as exc:  # noqa: BLE001
            special[key] = f"{type(value).__name__} that numpy cannot convert ({exc})"
            continue
        if array.dtype.name in safetensors.CODES:
            arrays[key] = array
        else:
            special[key] = f"an array of dtype {array.dtype}, shape {tuple(array.shape)}"
    return keys, special, arrays


def layout_reply(adapter: Any, world: int) -> dict[str, Any]:
    """The reply to ``layout``: the adapter's layout at ``world`` (a dict), launcher, promised collectives."""
    layout = adapter.layout(world)
    if not isinstance(layout, Layout) or layout.world != world:
        raise AdapterError(f"layout({world}) returned {layout!r}, not a Layout of world {world}")
    declared = getattr(adapter, "collectives", None)
    promised = declared(world) if callable(declared) else None  # None: no promise (not compared)
    return {"reply": LAYOUT_OP, "ok": True, "layout": layout.as_dict(),
            "launcher": getattr(adapter, "launcher", None),
            "collectives": None if promised is None else {str(k): int(v) for k, v in promised.items()}}


def serve_ranks(pipe: wire.Pipe, adapter: Any) -> None:
    """The worker's loop for a distributed adapter: ``layout``, ``supports``, ``ranks`` and ``close``
    requests, one reply each, until ``close`` or the end of the pipe.  After a hang the worker answers,
    then leaves (its stuck threads cannot be stopped): the runner starts a fresh one."""
    from ..worker import call_adapter, describe_exception, requests

    case: Case | None = None
    for header, payload in requests(pipe):
        op = header.get("op")
        if header.get("case") is not None:
            case = wire.case_from_message(header["case"], payload)
        reply: dict[str, Any]
        data: Any = b""
        stuck = False
        try:
            if op == LAYOUT_OP:
                reply = layout_reply(adapter, int(header["world"]))
            elif op == "supports" and case is not None:
                reply, data = call_adapter(adapter, "supports", case)
            elif op == RANKS_OP and case is not None:
                start = time.perf_counter()
                layout = adapter.layout(int(header["world"]))
                ranks, arrays, stuck = run_ranks(adapter, case, layout, header.get("timeout"))
                reply = {"reply": RANKS_OP, "ok": True, "seconds": time.perf_counter() - start, "ranks": ranks,
                         "stuck": stuck}
                data = safetensors.encode_parts(arrays)
            elif op in wire.OPS:  # a runner that asks run(case) of a distributed adapter
                reply = wire.failure(str(op).split("+")[0], f"adapter {getattr(adapter, 'name', '?')} is distributed "
                                     "(run_rank): it runs on ranks, e.g. mhaspec run ADAPTER --world N "
                                     "(docs/distributed.md)")
            else:
                raise wire.Malformed(f"a request with op {op!r} to a ranks worker")
        except wire.Malformed:
            raise
        except BaseException as exc:  # noqa: BLE001
            reply = wire.failure(op if op in (LAYOUT_OP, RANKS_OP, "supports") else RANKS_OP,
                                 f"{op}() raised {describe_exception(exc)}")
        reply["seq"] = header.get("seq")
        pipe.send(reply, data)
        if stuck:
            return  # the runner replaces this process


# -- the runner's side ------------------------------------------------------------------------------


class ThreadsLauncher:
    """:class:`~mhaspec.protocol.ranks.RankLauncher` for ``launcher = "threads"`` adapters: one worker
    process (a :class:`~.process.Worker`), ``world`` ranks as its threads.

    ``start(adapter, world)`` loads the adapter (a name, or an object a forked worker inherits) and returns
    its description with ``layout`` (a dict), ``launcher`` and ``collectives``; ``run(case, timeout)`` one
    :class:`RankReply` per rank; ``supports(case, timeout)`` the adapter's answer; ``close()`` stops the
    worker.  A worker that hung or died is replaced before the next case; :attr:`restarts` counts it."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self._options = options
        self._worker: _RanksWorker | None = None
        self.world = 0
        self.info: dict[str, Any] | None = None

    @property
    def restarts(self) -> int:
        return 0 if self._worker is None else self._worker.restarts

    @property
    def environment(self) -> dict[str, Any] | None:
        return None if self._worker is None else self._worker.environment

    def start(self, adapter: Any, world: int) -> dict[str, Any]:
        if not isinstance(world, int) or world < 1:
            raise AdapterError(f"world: expected a number of ranks >= 1, got {world!r}")
        self.close()
        self._worker, self.world = _RanksWorker(adapter, self._options), world
        info = dict(self._worker.wait_loaded())
        try:
            header, _ = self._worker.ask({"op": LAYOUT_OP, "world": world}, LAYOUT_OP, None, None)
        except (CaseTimeout, AdapterCrash) as exc:
            self.close()
            raise AdapterError(f"adapter {info['name']}: {exc}") from None
        if header.get("launcher") != "threads":
            self.close()
            raise AdapterError(f"adapter {info['name']}: its launcher is {header.get('launcher')!r}; the threads "
                               "launcher runs adapters whose launcher is \"threads\"")
        info.update(layout=header["layout"], launcher="threads", collectives=header["collectives"], world=world)
        self.info = info
        return info

    def supports(self, case: Case, timeout: float | None) -> bool | str:
        """The adapter's ``supports(case)`` answer (True where it has none)."""
        if self.info is None or self._worker is None:
            raise AdapterError("ThreadsLauncher.supports before start()")
        if not self.info.get("has_supports"):
            return True
        header, _ = self._worker.ask({"op": "supports"}, "supports", case, timeout)
        return header["answer"]

    def run(self, case: Case, timeout: float | None) -> list[RankReply]:
        """One reply per rank, in rank order; a crash or a hang is an error reply on the ranks it concerns."""
        if self.info is None or self._worker is None:
            raise AdapterError("ThreadsLauncher.run before start()")
        request = {"op": RANKS_OP, "world": self.world, "timeout": timeout}
        wait = None if timeout is None else timeout + GRACE
        try:
            header, data = self._worker.ask(request, RANKS_OP, case, wait)
        except (CaseTimeout, AdapterCrash) as exc:
            return [RankReply(r, None, f"rank {r}: {exc}") for r in range(self.world)]
        if header.get("stuck"):
            self._worker.discard()
        return _unpack_ranks(header, data, self.world)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self.info = None


def _unpack_ranks(header: Mapping[str, Any], data: bytes, world: int) -> list[RankReply]:
    arrays = safetensors.decode(data)
    replies = []
    for r, entry in enumerate(header["ranks"][:world]):
        if entry["error"] is not None:
            replies.append(RankReply(r, None, entry["error"], entry["issued"]))
            continue
        stages: dict[str, Any] = {}
        for key in entry["keys"]:
            if f"{r}/{key}" in arrays:
                stages[key] = arrays[f"{r}/{key}"]
            else:  # a value that could not travel as an array: judged as not an array
                stages[key] = entry["special"].get(key, "not an array")
        replies.append(RankReply(r, stages, None, entry["issued"]))
    return replies


class _RanksWorker(Worker):
    """A :class:`~.process.Worker` whose process serves ranks (:func:`serve_ranks`); :meth:`ask` sends one
    request and reads its reply, turning a deadline or a death into :class:`CaseTimeout` /
    :class:`AdapterCrash` and replacing the process."""

    def ask(self, request: dict[str, Any], reply_kind: str, case: Case | None, timeout: float | None
            ) -> tuple[dict[str, Any], bytes]:
        self._fresh_worker()
        assert self._pipe is not None
        self._seq += 1
        request = {**request, "seq": self._seq}
        payload: Any = b""
        if case is not None and self._sent is not case:
            header, payload = wire.case_message(case)
            request["case"] = header
            self._sent = case
        try:
            self._pipe.send(request, payload)
        except wire.Closed:
            pass  # the reply tells how it died
        return self._reply(reply_kind, case, timeout, self._seq)

    def discard(self) -> None:
        self._discard()
