"""The threads launcher (protocol/transports/threads_ranks.py): the ranks of a numpy distributed adapter
as threads of one worker process — its collectives, and what a rank that raises or hangs costs."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from mhaspec.errors import AdapterError
from mhaspec.protocol.transports.threads_ranks import ThreadsLauncher
from mhaspec.spec import CATALOG
from mhaspec.spec.ranks import Layout

CASE = CATALOG["self_basic"].case("float64")


def rank_value(rank: int) -> np.ndarray:
    """(2, 3) values that differ by rank and are exact in float64: rank r holds 10·r + arange."""
    return np.arange(6, dtype=np.float64).reshape(2, 3) + 10.0 * rank


class Collectives:
    """Every collective once; a stage per result (names are free here: the launcher carries any)."""

    name = "collectives"
    launcher = "threads"

    def layout(self, world: int) -> Layout:
        return Layout(cp=world)

    def run_rank(self, ctx, case):
        comm, r, w = ctx.comm, ctx.rank, ctx.world
        out = {"reduced": comm.all_reduce(rank_value(r)),
               "gathered": np.stack(comm.all_gather(rank_value(r))),
               "traded": np.stack(comm.all_to_all([rank_value(r)[:, :1] + j for j in range(w)])),
               "ring": comm.send_recv(rank_value(r), to=(r + 1) % w, source=(r - 1) % w),
               "pid": np.array([os.getpid()], dtype=np.int64)}
        if w > 1:  # a sub-group: ranks 0 and 1 only
            if r < 2:
                out["pair"] = comm.all_reduce(rank_value(r), ranks=(0, 1))
        return out


class Faulty(Collectives):
    """Rank 1 misbehaves the way ``case.id`` names."""

    name = "faulty"

    def run_rank(self, ctx, case):
        if ctx.rank == 1:
            if case.id == "self_basic":
                raise ValueError("rank one is broken")
            if case.id == "no_bias":
                return {}  # returns without calling the all_reduce its peers call
            if case.id == "one_head":
                while True:  # a hang outside any collective
                    time.sleep(0.05)
            if case.id == "head_dim_1":
                ctx.comm.all_gather(rank_value(1))  # another collective than its peers'
                return {}
        return {"reduced": ctx.comm.all_reduce(rank_value(ctx.rank))}


@pytest.fixture
def launcher():
    launchers = []

    def start(adapter, world):
        lx = ThreadsLauncher()
        launchers.append(lx)
        return lx, lx.start(adapter, world)

    yield start
    for lx in launchers:
        lx.close()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_deterministic_and_counted(launcher, world):
    lx, info = launcher(Collectives(), world)
    assert info["layout"] == Layout(cp=world).as_dict() and info["launcher"] == "threads"
    replies = lx.run(CASE, timeout=30)
    assert [r.rank for r in replies] == list(range(world))
    values = [rank_value(r) for r in range(world)]
    expected_sum = values[0]
    for v in values[1:]:
        expected_sum = expected_sum + v
    pids = {int(r.stages["pid"][0]) for r in replies}
    assert len(pids) == 1 and pids != {os.getpid()}  # one worker process, not the runner's
    for reply in replies:
        r = reply.rank
        assert reply.error is None, reply.error
        np.testing.assert_array_equal(reply.stages["reduced"], expected_sum)
        np.testing.assert_array_equal(reply.stages["gathered"], np.stack(values))
        np.testing.assert_array_equal(reply.stages["traded"], np.stack([values[j][:, :1] + r for j in range(world)]))
        np.testing.assert_array_equal(reply.stages["ring"], values[(r - 1) % world])
        in_pair = world > 1 and r < 2
        if in_pair:
            np.testing.assert_array_equal(reply.stages["pair"], values[0] + values[1])
        assert reply.issued == {"all_reduce": 1 + in_pair, "all_gather": 1, "all_to_all": 1, "send_recv": 1}


def test_a_rank_that_raises_is_named(launcher):
    lx, _ = launcher(Faulty(), 2)
    r0, r1 = lx.run(CASE, timeout=30)
    assert r1.stages is None and r1.error.startswith("rank 1: run_rank() raised ValueError: rank one is broken")
    assert r0.stages is None and "rank 0: all_reduce #1 over ranks (0, 1) never completes: rank 1 failed" in r0.error
    assert lx.restarts == 0  # no thread left behind: the worker serves the next case
    ok = lx.run(CATALOG["gqa"].case("float64"), timeout=30)
    assert all(r.error is None for r in ok)


def test_a_peer_that_returns_without_the_collective(launcher):
    lx, _ = launcher(Faulty(), 4)
    replies = lx.run(CATALOG["no_bias"].case("float64"), timeout=30)
    assert replies[1].error is None and replies[1].stages == {}
    for r in (0, 2, 3):
        assert replies[r].error == (f"rank {r}: all_reduce #1 over ranks (0, 1, 2, 3) never completes: "
                                    "rank 1 returned without calling it")


def test_mismatched_collectives_are_named(launcher):
    lx, _ = launcher(Faulty(), 2)
    r0, r1 = lx.run(CATALOG["head_dim_1"].case("float64"), timeout=30)
    errors = sorted([r0.error, r1.error])
    assert any("a peer called" in e for e in errors), errors


def test_a_hang_ends_at_the_timeout_naming_the_ranks_and_the_worker_is_replaced(launcher):
    lx, _ = launcher(Faulty(), 2)
    pid = lx._worker._process.pid
    start = time.monotonic()
    r0, r1 = lx.run(CATALOG["one_head"].case("float64"), timeout=1.0)
    assert time.monotonic() - start < 10
    assert r0.error == "rank 0: all_reduce #1 over ranks (0, 1): still waiting at the timeout"
    assert r1.error == "rank 1: no answer within the 1 s timeout, still computing (not in a collective)"
    ok = lx.run(CASE.model_copy(update={"id": "gqa"}), timeout=30)
    assert lx.restarts == 1 and all(r.error is None for r in ok)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung worker is gone


def test_a_worker_killed_costs_the_case_on_every_rank(launcher):
    class Dies(Collectives):
        def run_rank(self, ctx, case):
            if ctx.rank == 1 and case.id == "self_basic":
                os._exit(3)
            return super().run_rank(ctx, case)

    lx, _ = launcher(Dies(), 2)
    replies = lx.run(CASE, timeout=30)
    assert all(r.stages is None and r.error.startswith(f"rank {r.rank}: worker exited with status 3") for r in replies)
    assert all(r.error is None for r in lx.run(CATALOG["gqa"].case("float64"), timeout=30))


def test_only_threads_adapters(launcher):
    class Torchish(Collectives):
        launcher = "torch"

    with pytest.raises(AdapterError, match="launcher is 'torch'"):
        launcher(Torchish(), 2)


def test_a_rank_holding_the_gil_costs_the_case_on_every_rank_and_no_process_is_left(launcher):
    class NativeHang(Collectives):
        def run_rank(self, ctx, case):
            if ctx.rank == 0 and case.id == "self_basic":
                import ctypes

                ctypes.PyDLL(None).sleep(600)  # C code holding the GIL: the worker cannot even answer
            return super().run_rank(ctx, case)

    lx, _ = launcher(NativeHang(), 2)
    pid = lx._worker._process.pid
    start = time.monotonic()
    replies = lx.run(CASE, timeout=0.5)
    assert time.monotonic() - start < 30
    for r in replies:
        assert r.stages is None and r.error.startswith(f"rank {r.rank}: the adapter did not return within 5.5 s"), r.error
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert all(r.error is None for r in lx.run(CATALOG["gqa"].case("float64"), timeout=30))
    assert lx.restarts == 1


def test_a_builtin_loaded_by_name_in_a_spawned_worker(launcher, monkeypatch):
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")
    lx, info = launcher("numpy-allgather", 2)
    assert info["name"] == "numpy-allgather" and info["collectives"] == {"all_gather": 1}
    replies = lx.run(CATALOG["one_head"].case("float32"), timeout=60)
    assert [r.error for r in replies] == [None, None]
    assert replies[0].stages["output"].dtype == np.float32 and replies[0].issued == {"all_gather": 1}


def test_a_distributed_adapter_asked_to_run_whole_says_so():
    from mhaspec.protocol.transports import AdapterCrash, Worker

    worker = Worker("numpy-tp")
    try:
        worker.wait_loaded()
        with pytest.raises(AdapterCrash, match=r"numpy-tp is distributed \(run_rank\).*--world N"):
            worker.supports(CASE, timeout=30)
    finally:
        worker.close()


def test_promised_collectives_travel_with_the_layout(launcher):
    class Promising(Collectives):
        def collectives(self, world):
            return {"all_reduce": 2, "all_gather": 1, "all_to_all": 1, "send_recv": 1} if world > 1 else {}

    class Silent(Collectives):
        def collectives(self, world):
            return None  # no promise: nothing to compare

    assert launcher(Promising(), 2)[1]["collectives"] == {"all_reduce": 2, "all_gather": 1, "all_to_all": 1,
                                                          "send_recv": 1}
    assert launcher(Promising(), 1)[1]["collectives"] == {}
    assert launcher(Silent(), 2)[1]["collectives"] is None
    assert launcher(Collectives(), 2)[1]["collectives"] is None  # none declared
