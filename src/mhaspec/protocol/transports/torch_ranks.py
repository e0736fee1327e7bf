"""The ranks of a torch.distributed adapter: one process each, gloo, on this machine (docs/distributed.md).

:class:`TorchLauncher` (a :class:`~mhaspec.protocol.ranks.RankLauncher`) starts ``world`` fresh Python
interpreters (nothing inherited from the runner: the spawn start method), each with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` = 127.0.0.1, ``MASTER_PORT`` = a free port) and two pipes of
``mhaspec-wire/1`` frames.  Each rank sets ``torch.set_num_threads(1)``, initialises the default process
group once (gloo), loads the adapter and answers ``ready``; then, per case, it reads the case (the wire's
safetensors bytes, never a pickle), calls ``adapter.run_rank(ctx, case)`` under :class:`CollectiveCounter`
and answers with its stages (safetensors), its error (one line) and the collectives it issued.

A rank that raises gives its error reply; a rank that dies (a signal, an exit) or does not answer within
the case's timeout gives an error reply naming it; after any error every rank is killed, and a fresh group
is started for the next case (a collective left half done poisons the group).  :meth:`TorchLauncher.close`
leaves no process behind.

The rank's side (:func:`rank_reply`, :func:`init_group`, :func:`encode_reply`) is shared with the SPMD entry
point ``python -m mhaspec.dist`` (torchrun, srun), which runs the same per-rank step without pipes.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import select
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import AdapterError
from ...io import safetensors
from ...spec import Case
from .. import wire
from ..ranks import RankContext, RankReply, is_distributed
from ..worker import requests
from .process import LOAD_TIMEOUT, Process, death_cause

#: The collective kinds of torch's c10d ops (``torch.ops.c10d`` as ``dist.*`` dispatches them, and the
#: functional collectives DTensor issues), by the op's name; a point-to-point pair counts once, at the send.
KINDS: dict[str, str] = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "send": "send_recv",
}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

#: Seconds the other ranks get to answer once one rank has failed (raised, died) before they are stopped.
GRACE = 5.0

#: Seconds a collective may wait for its peers before gloo gives up (the launcher's own timeout kills first).
GROUP_TIMEOUT = 300.0


def collective_counter() -> Any:
    """A ``TorchDispatchMode`` counting the collectives issued under it, by kind (:data:`KINDS`): every c10d
    op reaches the dispatcher — ``dist.all_reduce``, ``dist.batch_isend_irecv``'s sends, DTensor's functional
    collectives.  (torch's ``CommDebugMode`` counts the same collectives but not send/recv.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace in _NAMESPACES:
                kind = KINDS.get(func.overloadpacket.__name__)
                if kind is not None:
                    self.counts[kind] += 1
            return func(*args, **(kwargs or {}))

    return CollectiveCounter()


def warm_up() -> None:
    """A dispatch mode's first use imports a few seconds' worth of torch: paid while loading, not in a case."""
    import torch

    with collective_counter():
        torch.zeros(1).add_(1)


def init_group(rank: int, world: int, backend: str = "gloo", timeout: float | None = None) -> Any:
    """The default process group (torchrun's ``env://``: ``MASTER_ADDR``, ``MASTER_PORT``), once; its handle.
    ``timeout``: seconds a collective waits for its peers (default :data:`GROUP_TIMEOUT`)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # every rank on the same few cores
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout or GROUP_TIMEOUT))
    return dist.group.WORLD


def load_rank_adapter(ref: str, world: int) -> tuple[Any, Any]:
    """(the distributed adapter ``ref``, its layout at ``world``); :class:`AdapterError` when it is not one
    or its layout is for another world size."""
    from ..loading import load_adapter

    adapter = load_adapter(ref)
    if not is_distributed(adapter):
        raise AdapterError(f"adapter {ref!r} has no run_rank(ctx, case): not a distributed adapter "
                           "(docs/distributed.md)")
    layout = adapter.layout(world)
    if layout.world != world:
        raise AdapterError(f"adapter {ref!r}: layout(world = {world}) is {layout.describe()}, "
                           f"world {layout.world} (tp · cp must be the world size)")
    return adapter, layout


def describe_ranks(adapter: Any, layout: Any, world: int) -> dict[str, Any]:
    """The adapter's description (``ready``) with its layout, launcher and promised collectives."""
    from ..contract import describe_adapter

    promised = getattr(adapter, "collectives", None)
    return {**describe_adapter(adapter), "layout": layout.as_dict(), "launcher": "torch", "world": world,
            "collectives": None if promised is None else dict(promised(world) or {})}


def rank_reply(adapter: Any, ctx: RankContext, case: Case) -> RankReply:
    """``adapter.run_rank(ctx, case)`` with its collectives counted: the rank's stages as numpy arrays, or
    its error (one line naming the rank)."""
    from ..worker import describe_exception

    counter = collective_counter()
    try:
        with counter:
            returned = adapter.run_rank(ctx, case)
        stages = {str(name): np.asarray(value) for name, value in dict(returned).items()}
        odd = [f"{n} ({a.dtype})" for n, a in stages.items() if a.dtype.name not in safetensors.CODES]
        if odd:
            raise TypeError(f"stages of a dtype that cannot travel: {', '.join(odd)}")
    except BaseException as exc:  # noqa: BLE001 - anything the adapter raises is the rank's verdict
        return RankReply(ctx.rank, None, f"rank {ctx.rank}: run_rank() raised {describe_exception(exc)}",
                         dict(counter.counts))
    ctx.issued.update(counter.counts)
    return RankReply(ctx.rank, stages, None, dict(counter.counts))


def encode_reply(reply: RankReply, seconds: float = 0.0) -> tuple[dict[str, Any], safetensors.Parts | bytes]:
    """A rank's reply as a frame's (header, payload): the stages as safetensors bytes."""
    header = {"reply": "rank", "ok": True, "rank": reply.rank, "error": reply.error, "issued": reply.issued,
              "seconds": seconds}
    return header, safetensors.encode_parts(reply.stages) if reply.stages is not None else b""


def decode_reply(header: dict[str, Any], payload: bytes) -> RankReply:
    """The :class:`RankReply` of :func:`encode_reply`'s frame (:class:`wire.Malformed` for anything else)."""
    if header.get("reply") != "rank" or not isinstance(header.get("rank"), int):
        raise wire.Malformed(f"a reply of kind {header.get('reply')!r} where a rank's reply was due")
    stages = None if header.get("error") else dict(safetensors.decode(payload)) if payload else {}
    return RankReply(header["rank"], stages, header.get("error"), header.get("issued"))


# -- the rank process ------------------------------------------------------------------------------------------


def rank_main(argv: list[str]) -> None:
    """A rank process: ``READ_FD WRITE_FD PARENT_PID ADAPTER``; RANK, WORLD_SIZE, MASTER_* in the environment."""
    from ..worker import EXIT_BROKEN, describe_exception, detach_from_terminal_signals, finish

    code = 0
    try:
        pipe = wire.Pipe(int(argv[0]), int(argv[1]))
        detach_from_terminal_signals(int(argv[2]), True)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        try:
            group = init_group(rank, world)
            adapter, layout = load_rank_adapter(argv[3], world)
            info = describe_ranks(adapter, layout, world)
            warm_up()
        except BaseException as exc:  # noqa: BLE001
            error = str(exc) if isinstance(exc, AdapterError) else describe_exception(exc)
            pipe.send(wire.failure("ready", f"rank {rank}: {error}"))
            return
        pipe.send({**wire.ready(info, {}), "rank": rank})
        serve_rank(pipe, adapter, RankContext(rank, world, layout, group=group))
    except BaseException:  # noqa: BLE001 - a broken rank must still leave at once
        import traceback

        traceback.print_exc()
        code = EXIT_BROKEN
    finally:
        finish(code)


def serve_rank(pipe: wire.Pipe, adapter: Any, ctx: RankContext) -> None:
    """Answer ``run`` requests until ``close`` or the end of the pipe."""
    for header, payload in requests(pipe):
        if header.get("op") != "run":
            raise wire.Malformed(f"a request with op {header.get('op')!r} to a rank")
        case = wire.case_from_message(header["case"], payload)
        start = time.perf_counter()
        reply = rank_reply(adapter, RankContext(ctx.rank, ctx.world, ctx.layout, group=ctx.group), case)
        pipe.send(*encode_reply(reply, time.perf_counter() - start))


# -- the launcher (the runner's side) --------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the group's rendezvous)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchLauncher:
    """``world`` rank processes of a torch.distributed adapter, gloo on this machine (module docstring)."""

    def __init__(self, load_timeout: float = LOAD_TIMEOUT) -> None:
        self._load_timeout = load_timeout
        self._adapter: str | None = None
        self._world = 0
        self._ranks: list[tuple[Process, wire.Pipe]] = []
        self.info: dict[str, Any] | None = None
        #: How many times the ranks were replaced after a case that went wrong.
        self.restarts = 0

    @property
    def processes(self) -> list[Process]:
        """The rank processes running now (none before :meth:`start` and after :meth:`close`)."""
        return [p for p, _ in self._ranks]

    def start(self, adapter: str, world: int) -> dict[str, Any]:
        if not isinstance(adapter, str):
            raise AdapterError(f"adapter {adapter!r}: the torch launcher loads the adapter by name in each rank's "
                               "process: give a built-in name, package.module:attr or path/to/file.py:attr")
        if world < 1:
            raise AdapterError(f"--world: the number of ranks is >= 1, got {world}")
        self._adapter, self._world = adapter, world
        self._launch()
        assert self.info is not None
        return self.info

    def _launch(self) -> None:
        """Start every rank and read each one's ``ready``; on any failure none is left running."""
        assert self._adapter is not None
        port = free_port()
        root = str(Path(__file__).resolve().parents[3])
        code = (f"import sys; sys.path.insert(0, {root!r}); "
                "from mhaspec.protocol.transports.torch_ranks import rank_main; rank_main(sys.argv[1:])")
        for rank in range(self._world):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self._world),
                   "LOCAL_WORLD_SIZE": str(self._world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            to_child_r, to_child_w = os.pipe()
            to_parent_r, to_parent_w = os.pipe()
            try:
                popen = subprocess.Popen([sys.executable, "-c", code, str(to_child_r), str(to_parent_w),
                                          str(os.getpid()), self._adapter], pass_fds=(to_child_r, to_parent_w),
                                         env=env)
            except OSError as exc:
                for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
                    os.close(fd)
                self._discard()
                raise AdapterError(f"cannot start rank {rank} ({exc})") from None
            os.close(to_child_r)
            os.close(to_parent_w)
            self._ranks.append((Process(popen=popen), wire.Pipe(to_parent_r, to_child_w)))
        deadline = time.monotonic() + self._load_timeout
        for rank, (process, pipe) in enumerate(self._ranks):
            try:
                header, _ = pipe.recv(deadline)
                wire.check_protocol(header, f"rank {rank}")
            except wire.Deadline:
                self._discard()
                raise AdapterError(f"adapter {self._adapter}: rank {rank} did not load within "
                                   f"{self._load_timeout:g} s") from None
            except wire.Closed:
                cause = death_cause(process.poll(wait=2.0))
                self._discard()
                raise AdapterError(f"adapter {self._adapter}: rank {rank}: {cause} while loading") from None
            except (wire.Malformed, wire.ProtocolError) as exc:
                self._discard()
                raise AdapterError(f"adapter {self._adapter}: rank {rank}: {exc}") from None
            if not header.get("ok"):
                self._discard()
                raise AdapterError(str(header.get("error")))
            if rank == 0:
                self.info = {k: v for k, v in header.items() if k not in ("ok", "reply", "protocol", "rank",
                                                                            "environment")}

    def run(self, case: Case, timeout: float | None) -> list[RankReply]:
        """``case`` on every rank: one reply per rank, in rank order (module docstring)."""
        if not self._ranks:
            self.restarts += 1
            self._launch()
        header, payload = wire.case_message(case)
        for _, pipe in self._ranks:
            try:
                pipe.send({"op": "run", "case": header}, payload)
            except wire.Closed:
                pass  # its reply says how it died
        replies = self._collect(None if not timeout else time.monotonic() + timeout, timeout)
        if any(r.error for r in replies):
            self._discard()  # a fresh group for the next case
        return replies

    def _collect(self, deadline: float | None, timeout: float | None) -> list[RankReply]:
        """Every rank's reply as it comes; once one rank has failed the others get :data:`GRACE` seconds more
        (its peers may wait in a collective it never joins), then the rest are named as stopped."""
        poller = select.poll()
        fds = {pipe.read_fd: rank for rank, (_, pipe) in enumerate(self._ranks)}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        got: dict[int, RankReply] = {}
        failed: RankReply | None = None
        limit = deadline
        while len(got) < len(self._ranks):
            wait = -1 if limit is None else max(0, int((limit - time.monotonic()) * 1000))
            ready = poller.poll(wait)
            if not ready and limit is not None and time.monotonic() >= limit:
                break
            for fd, _ in ready:
                rank = fds[fd]
                process, pipe = self._ranks[rank]
                got[rank] = self._reply(rank, process, pipe, deadline, timeout)
                poller.unregister(fd)
                if got[rank].error and failed is None:
                    failed = got[rank]
                    limit = min(deadline or math.inf, time.monotonic() + GRACE)
        for rank in range(len(self._ranks)):
            if rank not in got:
                why = (f"stopped {GRACE:g} s after rank {failed.rank} failed" if failed is not None
                       else f"did not answer within {timeout:g} s (per-case timeout)")
                got[rank] = RankReply(rank, None, f"rank {rank}: {why}; every rank was killed")
        return [got[rank] for rank in range(len(self._ranks))]

    def _reply(self, rank: int, process: Process, pipe: wire.Pipe, deadline: float | None,
               timeout: float | None) -> RankReply:
        try:
            header, payload = pipe.recv(deadline)
            return decode_reply(header, payload)
        except wire.Deadline:  # readable, then a partial frame until the deadline
            return RankReply(rank, None, f"rank {rank}: did not finish its reply within {timeout:g} s; "
                                         "every rank was killed")
        except wire.Closed:
            return RankReply(rank, None, f"rank {rank}: {death_cause(process.poll(wait=2.0))}; every rank was killed")
        except (wire.Malformed, safetensors.SafetensorsError) as exc:
            return RankReply(rank, None, f"rank {rank}: sent {exc}; every rank was killed")

    def _discard(self) -> None:
        """Kill every rank (each pipe closed first, then SIGKILL and reaped)."""
        for process, pipe in self._ranks:
            pipe.close()
            process.kill()
        self._ranks = []

    def close(self) -> None:
        """Ask every rank to leave, then make sure each did; idempotent."""
        for _, pipe in self._ranks:
            try:
                pipe.send(wire.close_request())
            except wire.Closed:
                pass
        for process, _ in self._ranks:
            process.poll(wait=2.0)
        self._discard()

