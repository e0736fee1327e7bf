"""``python -m mhaspec.dist ADAPTER [mhaspec run's options]``: a distributed adapter judged under torchrun or
srun, one process per rank, or (an adapter of the ``jax`` launcher) under ``jax.distributed.initialize``, one
process per host (docs/distributed.md, "On a cluster").

Every process of the job runs this module.  Each reads its place from the environment — torchrun's
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (or Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS`` with
``MASTER_ADDR`` and ``MASTER_PORT`` exported by the batch script) — initialises the default process group
(gloo; ``cpu:gloo,cuda:nccl`` where CUDA is available, so that CPU tensors still travel by gloo), loads the
adapter, and then:

* rank 0 runs ``mhaspec run ADAPTER --world WORLD_SIZE`` with the remaining options (``--catalog``,
  ``--report``, ``--dtype``, ``-k``, …) and :class:`SpmdLauncher` as its launcher: each case goes to every rank
  as the wire's bytes (``dist.broadcast`` of a uint8 tensor), every rank runs ``run_rank`` on it with its
  collectives counted, and the replies come back to rank 0 as bytes (``dist.gather``; never
  ``gather_object``'s pickles), where the rank judge (:mod:`mhaspec.conformance.ranks`) judges them;
* every other rank follows: a case, its rank, its reply, until rank 0 says it is done.

The exit status is ``mhaspec run``'s (0 conforms, 1 fails, 2 a usage error), rank 0's, sent to every rank
so that every process exits with it.

A JAX adapter (``launcher = "jax"``) takes :func:`jax_main` instead: every process calls
``jax.distributed.initialize`` (``--coordinator``, ``--num-processes``, ``--process-id``, or what JAX reads from
the cluster's environment, e.g. Slurm's), and every process runs the same ``mhaspec run ADAPTER --world N``
(N = ``jax.device_count()``, every process's devices) with :class:`JaxClusterLauncher`: the case selection is
the same everywhere, so every process issues the same SPMD programs in the same order, and each gets every
rank's stages (the built-in adapters gather them across processes).  Process 0 prints and writes the report;
the others compute in silence.  A rank that hangs is bounded by the group's timeout (``--timeout``,
default :data:`~mhaspec.protocol.transports.torch_ranks.GROUP_TIMEOUT`), not killed: the processes are
torchrun's or srun's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from .protocol import wire
from .protocol.ranks import RankContext, RankReply
from .protocol.transports.torch_ranks import (decode_reply, describe_ranks, encode_reply, init_group, load_rank_adapter,
                                              rank_reply)
from .spec import Case


def place() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment (``RANK``, ``WORLD_SIZE``) or Slurm's
    (``SLURM_PROCID``, ``SLURM_NTASKS``); :class:`SystemExit` (2) naming what is missing."""
    for rank_var, world_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in os.environ and world_var in os.environ:
            try:
                return int(os.environ[rank_var]), int(os.environ[world_var])
            except ValueError:
                usage(f"{rank_var}={os.environ[rank_var]!r}, {world_var}={os.environ[world_var]!r}: not integers")
    usage("RANK and WORLD_SIZE are not set: run under torchrun (torchrun --nproc-per-node N -m mhaspec.dist ADAPTER) "
          "or srun (SLURM_PROCID, SLURM_NTASKS, with MASTER_ADDR and MASTER_PORT exported)")
    raise AssertionError  # usage() does not return


def usage(message: str) -> None:
    print(f"mhaspec.dist: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- bytes between the ranks (uint8 tensors on the CPU: gloo) -------------------------------------------------


def broadcast_bytes(data: bytes | None, rank: int) -> bytes:
    """Rank 0's ``data`` on every rank (its length first, then the bytes)."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data) if rank == 0 and data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0)
    if rank == 0 and data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        dist.broadcast(buf, 0)
    return buf.numpy().tobytes()


def gather_bytes(data: bytes, rank: int, world: int) -> list[bytes] | None:
    """Every rank's ``data`` on rank 0, in rank order (None on the others): the lengths by ``all_gather``, the
    bytes padded to the longest by ``gather``."""
    import torch
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, bufs, dst=0)
    if bufs is None:
        return None
    return [b[:int(s)].numpy().tobytes() for b, s in zip(bufs, sizes)]


# -- the launcher rank 0 gives the runner, and the other ranks' loop --------------------------------------------


class SpmdLauncher:
    """A :class:`~mhaspec.protocol.ranks.RankLauncher` for rank 0 of a job whose ranks are already running
    (this module's docstring): :meth:`run` sends the case to every rank, runs rank 0's share, gathers the
    replies.  :meth:`close` is left to :func:`main`, which tells the ranks the exit status."""

    def __init__(self, ref: str, adapter: Any, ctx: RankContext, info: dict[str, Any]) -> None:
        self.ref, self.adapter, self.ctx, self.info = ref, adapter, ctx, info

    def start(self, adapter: Any, world: int) -> dict[str, Any]:
        if world != self.ctx.world:
            raise ValueError(f"--world {world}: this job has WORLD_SIZE = {self.ctx.world}")
        return self.info

    def run(self, case: Case, timeout: float | None) -> list[RankReply]:
        header, payload = wire.case_message(case)
        broadcast_bytes(wire.encode_frame({"op": "run", "case": header}, payload), 0)
        return follow_case(self.adapter, self.ctx, case)  # type: ignore[return-value]

    def close(self) -> None:
        """Nothing here: :func:`main` ends the other ranks' loop with the exit status."""


def follow_case(adapter: Any, ctx: RankContext, case: Case) -> list[RankReply] | None:
    """This rank's share of ``case``, its reply gathered to rank 0 (every reply there, None elsewhere)."""
    mine = rank_reply(adapter, RankContext(ctx.rank, ctx.world, ctx.layout, group=ctx.group), case)
    frames = gather_bytes(wire.encode_frame(*encode_reply(mine)), ctx.rank, ctx.world)
    return None if frames is None else [decode_reply(*wire.decode_frame(f)) for f in frames]


def follow(adapter: Any, ctx: RankContext) -> int:
    """A rank other than 0: run each case rank 0 sends; the exit status it sends last."""
    while True:
        header, payload = wire.decode_frame(broadcast_bytes(None, ctx.rank))
        if header.get("op") == "close":
            return int(header.get("exit", 1))
        follow_case(adapter, ctx, wire.case_from_message(header["case"], payload))


def loaded_everywhere(ref: str, rank: int, world: int) -> tuple[Any, Any] | None:
    """(adapter, layout) loaded on this rank, once every rank has loaded it; None (and, on rank 0, the
    first rank's error printed) when any rank could not."""
    try:
        adapter, layout = load_rank_adapter(ref, world)
        error = ""
    except Exception as exc:  # noqa: BLE001 - reported by rank 0, every rank leaves
        adapter = layout = None
        error = f"rank {rank}: {exc}"
    errors = gather_bytes(error.encode(), rank, world)
    failed = broadcast_bytes(b"".join(errors) if errors is not None else None, rank)
    if failed:
        if errors is not None:  # rank 0
            print("mhaspec.dist: error: " + next(e.decode() for e in errors if e), file=sys.stderr)
        return None
    return adapter, layout


class JaxClusterLauncher:
    """A :class:`~mhaspec.protocol.ranks.RankLauncher` for one process of a JAX job (:func:`jax_main`): every
    rank of a case through the one SPMD program on the job's global mesh
    (:func:`~mhaspec.protocol.transports.jax_ranks.run_ranks`)."""

    def __init__(self, adapter: Any, layout: Any, mesh: Any, info: dict[str, Any]) -> None:
        self.adapter, self.layout, self.mesh, self.info = adapter, layout, mesh, info

    def start(self, adapter: Any, world: int) -> dict[str, Any]:
        if world != self.layout.world:
            raise ValueError(f"--world {world}: this job has {self.layout.world} devices")
        return self.info

    def run(self, case: Case, timeout: float | None) -> list[RankReply]:
        from .protocol.transports.jax_ranks import run_ranks

        return run_ranks(self.adapter, self.layout, self.mesh, case)

    def close(self) -> None:
        """Nothing: the processes are the job's."""


def without_report(options: Sequence[str]) -> list[str]:
    """``options`` without ``--report FILE`` / ``--report=FILE`` (only process 0 writes the report)."""
    out, skip = [], False
    for option in options:
        if skip:
            skip = False
        elif option == "--report":
            skip = True
        elif not option.startswith("--report="):
            out.append(option)
    return out


def jax_main(args: argparse.Namespace, rest: Sequence[str]) -> int:
    """Every process of a JAX job (module docstring): the same run everywhere, process 0's output and status."""
    import contextlib
    import io

    import jax

    from . import cli
    from .protocol.loading import load_adapter
    from .protocol.transports.jax_ranks import checked_layout, mesh_for

    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
    world = jax.device_count()
    try:
        adapter = load_adapter(args.adapter)
        layout = checked_layout(adapter, world)
    except Exception as exc:  # noqa: BLE001 - a usage error, named, on every process
        usage(f"process {jax.process_index()}: {exc}")
    info = {**describe_ranks(adapter, layout, world), "launcher": "jax"}
    launcher = JaxClusterLauncher(adapter, layout, mesh_for(layout, jax.devices()), info)
    given = ["--timeout", args.timeout] if args.timeout is not None else []
    argv = ["run", args.adapter, "--no-isolate", "--world", str(world), *given, *rest]
    if jax.process_index() == 0:
        return cli.main(argv, launcher=launcher)
    with contextlib.redirect_stdout(io.StringIO()):
        return cli.main(without_report(argv), launcher=launcher)


def _jax_adapter(ref: str) -> bool:
    """Whether ``ref`` names an adapter of the ``jax`` launcher (a built-in's module is not imported to tell)."""
    from .protocol.loading import BUILTINS, load_adapter

    if ref in BUILTINS:
        return BUILTINS[ref].target.startswith("mhaspec.adapters.jax_ranks:")
    try:
        return getattr(load_adapter(ref), "launcher", None) == "jax"
    except Exception:  # noqa: BLE001 - the torch path reports a broken adapter, naming the rank
        return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mhaspec.dist",
        description="One rank of a distributed adapter under torchrun or srun (a JAX adapter: one process per "
        "host under jax.distributed.initialize); rank 0 judges every rank (docs/distributed.md, \"On a cluster\"). "
        "Every option but --backend, --coordinator, --num-processes and --process-id is mhaspec run's.")
    parser.add_argument("adapter",
                        help="a distributed adapter: torch-tp, torch-ring, …, or module:attr, file.py:attr")
    parser.add_argument("--backend", choices=("gloo", "nccl", "cpu:gloo,cuda:nccl"), default=None,
                        help="the process group's backend (default: gloo; cpu:gloo,cuda:nccl where CUDA is available)")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="a JAX adapter: jax.distributed.initialize's coordinator address (default: from the "
                        "cluster's environment, e.g. Slurm's)")
    parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                        help="a JAX adapter: the job's processes (default: from the cluster's environment)")
    parser.add_argument("--process-id", type=int, default=None, metavar="I",
                        help="a JAX adapter: this process's index (default: from the cluster's environment)")
    parser.add_argument("--timeout", default=None, metavar="SECONDS",
                        help="how long a collective waits for its peers (the group's timeout), and mhaspec run's "
                        "per-case timeout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if _jax_adapter(args.adapter):
        return jax_main(args, rest)
    rank, world = place()
    import torch

    from . import cli
    from .protocol.transports import validate_timeout

    timeout = validate_timeout(args.timeout, "--timeout") if args.timeout is not None else None
    backend = args.backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    group = init_group(rank, world, backend, timeout)
    try:
        loaded = loaded_everywhere(args.adapter, rank, world)
        if loaded is None:
            return 2
        adapter, layout = loaded
        ctx = RankContext(rank, world, layout, group=group)
        if rank:
            return follow(adapter, ctx)
        launcher = SpmdLauncher(args.adapter, adapter, ctx, describe_ranks(adapter, layout, world))
        code = 2
        try:
            given = ["--timeout", args.timeout] if args.timeout is not None else []
            code = cli.main(["run", args.adapter, "--no-isolate", "--world", str(world), *given, *rest],
                            launcher=launcher)
        finally:
            broadcast_bytes(wire.encode_frame({"op": "close", "exit": code}), 0)
        return code
    finally:
        import torch.distributed as dist

        dist.barrier()  # every rank done before any exits: torchrun stops the others when one exits non-zero
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
