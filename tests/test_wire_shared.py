"""Large payloads between the runner and its Python worker travel through shared memory (wire.SharedMemory).

The same bytes arrive, read-only; small payloads, and a platform without
``memfd_create``, keep the pipe, silently; whatever happens to the worker
leaves no descriptor, mapping or file behind in the runner.
"""

from __future__ import annotations

import gc
import mmap
import os
import signal
import threading
import time
import warnings

import numpy as np
import pytest

from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.io import safetensors
from mhaspec.protocol import wire
from mhaspec.protocol.transports import Worker
from mhaspec.protocol.transports.base import AdapterCrash, CaseTimeout
from mhaspec.spec import CaseSpec

pytestmark = pytest.mark.skipif(wire.SharedMemory.pair() is None, reason="no memfd_create or descriptor passing here")

#: T = S = 256, H = 4 in float64: scores and attn_weights 2 MiB each, a reply above wire.SHARED_MIN
T = S = 256


def _case(case_id: str = "big", dtype: str = "float64"):
    spec = CaseSpec.model_validate({"id": case_id, "config": {"d_model": 16, "num_heads": 4, "causal": True},
                                    "batch": 1, "tgt_len": T, "src_len": S, "seed": 3})
    return spec.case(dtype)


def _pipes():
    """(sender, receiver): two Pipes of this process, with shared memory between them, and their fds."""
    r, w = os.pipe()
    r2, w2 = os.pipe()
    shared, theirs = wire.SharedMemory.pair()
    return wire.Pipe(r2, w, wire.SharedMemory(theirs)), wire.Pipe(r, w2, shared)


def _mapping_of(array: np.ndarray) -> object:
    """What the memory of a decoded array belongs to (the buffer safetensors.decode viewed)."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def _open_fds() -> set[str]:
    return {f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}" for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")}


def _memory_files() -> list[str]:
    """This process's descriptors and mappings of payload memory files (none once their arrays are gone)."""
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if "mhaspec-payload" in line]
    return mapped + [f for f in _open_fds() if "mhaspec-payload" in f]


def test_a_large_payload_arrives_through_shared_memory_read_only_and_a_small_one_through_the_pipe():
    arrays = {"scores": np.arange(4 * 256 * 256, dtype=np.float32).reshape(1, 4, 256, 256),
              "output": np.linspace(-1, 1, 12).reshape(1, 3, 4)}
    parts = safetensors.encode_parts(arrays)
    assert len(parts) >= wire.SHARED_MIN
    sender, receiver = _pipes()
    try:
        sender.send({"reply": "run"}, parts)
        sender.send({"reply": "run", "n": 2}, safetensors.encode_parts({"output": arrays["output"]}))
        header, payload = receiver.recv()
        assert header == {"reply": "run"} and isinstance(payload, mmap.mmap)
        assert payload[:] == bytes(parts)
        decoded = safetensors.decode(payload)
        for name, array in arrays.items():
            assert _mapping_of(decoded[name]) is payload and not decoded[name].flags.writeable
            np.testing.assert_array_equal(decoded[name], array)
            with pytest.raises(ValueError):
                decoded[name].flags.writeable = True  # the mapping is read-only: the judge cannot write into it
        header, small = receiver.recv()
        assert header == {"reply": "run", "n": 2} and isinstance(small, bytearray)  # below SHARED_MIN: the pipe
        np.testing.assert_array_equal(safetensors.decode(small)["output"], arrays["output"])
        assert not receiver.readable()
    finally:
        sender.close()
        receiver.close()
    del decoded, payload
    gc.collect()
    assert _memory_files() == []


def test_without_memfd_the_pipe_carries_every_payload_silently(monkeypatch, capfd):
    def no_memfd(*args):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", no_memfd)
    parts = safetensors.encode_parts({"scores": np.ones((4, 256, 256), np.float32)})
    sender, receiver = _pipes()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                writer = threading.Thread(target=sender.send, args=({"reply": "run"}, parts))  # the pipe holds 64 KiB
                writer.start()
                _, payload = receiver.recv()
                writer.join()
                assert isinstance(payload, bytearray) and bytes(payload) == bytes(parts)
        assert sender.shared.usable is False  # tried once, then the pipe from then on
    finally:
        sender.close()
        receiver.close()
    assert capfd.readouterr() == ("", "")


def test_a_size_that_disagrees_with_the_frame_is_malformed():
    sender, receiver = _pipes()
    try:
        parts = safetensors.encode_parts({"scores": np.ones((4, 256, 256), np.float32)})
        assert sender.shared.carries(parts.buffers)
        wire.write_all(sender.write_fd, memoryview(wire.FRAME.pack(2, 8) + b"{}"))  # a frame of another size
        with pytest.raises(wire.Malformed, match="another size"):
            receiver.recv()
    finally:
        sender.close()
        receiver.close()
    gc.collect()
    assert _memory_files() == []


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_workers_large_reply_is_the_same_bytes_and_nothing_stays_behind(start, monkeypatch):
    monkeypatch.setenv("MHASPEC_WORKER_START", start)
    case = _case()
    expected = NumpyMHA().run(case)
    before, shm_before = _open_fds(), sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    worker = Worker("numpy")
    try:
        returned, _ = worker.run(case, timeout=60)
        assert all(_mapping_of(returned[name]) is _mapping_of(returned["scores"]) for name in expected)
        assert isinstance(_mapping_of(returned["scores"]), mmap.mmap)
        for name, array in expected.items():
            assert returned[name].tobytes() == np.ascontiguousarray(array).tobytes(), name
        assert _memory_files()  # mapped while its arrays live
    finally:
        worker.close()
    del returned
    gc.collect()
    assert _memory_files() == [] and _open_fds() == before
    assert (sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []) == shm_before


class _Faulty:
    """Returns a large reply for case ``big``, then crashes, hangs, or is killed on the next case."""

    name = "faulty-large"

    def run(self, case):
        if case.id == "exit":
            os._exit(3)
        if case.id == "hang":
            time.sleep(600)
        if case.id == "kill":
            NumpyMHA().run(case)
            os.kill(os.getpid(), signal.SIGKILL)
        return NumpyMHA().run(case)


@pytest.mark.parametrize("fault, error", [("exit", AdapterCrash), ("hang", CaseTimeout), ("kill", AdapterCrash)])
def test_a_crash_timeout_or_kill_after_a_large_reply_leaves_nothing_behind(fault, error):
    before = _open_fds()
    worker = Worker(_Faulty())
    try:
        returned, _ = worker.run(_case(), timeout=60)
        assert isinstance(_mapping_of(returned["scores"]), mmap.mmap)
        del returned
        with pytest.raises(error):
            worker.run(_case(fault), timeout=2)
        again, _ = worker.run(_case(), timeout=60)  # a fresh worker
        assert isinstance(_mapping_of(again["scores"]), mmap.mmap) and worker.restarts == 1
        del again
    finally:
        worker.close()
    gc.collect()
    assert _memory_files() == [] and _open_fds() == before
