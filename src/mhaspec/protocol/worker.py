"""The Python worker: the worker's side of ``mhaspec-wire/1``, in the process where the adapter computes.

:func:`serve` answers the runner's requests with the adapter; :func:`main` is the
entry point of a spawned worker (``READ_FD WRITE_FD PARENT_PID DIE_WITH_PARENT [SHARED_FD]``:
it reads ``load``, loads the adapter and answers ``ready``); :func:`run_forked` is
what a forked child runs.  Whatever the adapter raises is a reply; whatever it
does to the process (exit, abort, a signal) is the runner's to report
(mhaspec.protocol.transports).  A worker written in another language does what
:func:`serve` does, from docs/protocol.md alone.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..allocator import (WORKER_MMAP_THRESHOLD, WORKER_TRIM_THRESHOLD, keep_freed_pages, no_huge_page_advice,
                         release_freed_memory)
from ..environment import describe as describe_environment
from ..errors import AdapterError
from ..spec import Case
from . import wire
from .contract import adapter_name, describe_adapter
from .loading import load_adapter
from .ranks import is_distributed

#: The exit status of a worker that failed outside the adapter (a traceback is on its stderr).
EXIT_BROKEN = 70


def describe_exception(exc: BaseException) -> str:
    """``Type: message (file:line in function)`` at the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def call_adapter(adapter: Any, step: str, case: Case) -> tuple[dict[str, Any], bytes]:
    """The reply to one step (``supports``, ``run``, ``backward`` or ``decode``) of ``case``."""
    start = time.perf_counter()
    try:
        if step == "supports":
            return wire.supports_reply(adapter.supports(case)), b""
        if step == "decode":  # a case with a schedule: one mapping per call (docs/serving.md); never run()
            header, payload = wire.decoded_reply(adapter.decode(case), 0.0)
        else:
            returned = adapter.backward(case) if step == "backward" else adapter.run(case)
            header, payload = wire.returned_reply(step, returned, 0.0)
        header["seconds"] = time.perf_counter() - start  # converting lazy arrays is part of the adapter's time
        return header, payload
    except SystemExit as exc:
        return wire.failure(step, f"adapter called sys.exit({exc.code!r}) in {step}()"), b""
    except BaseException as exc:  # noqa: BLE001 - anything the adapter raises is its verdict
        return wire.failure(step, f"{step}() raised {describe_exception(exc)}"), b""


def requests(pipe: wire.Pipe) -> Iterator[tuple[dict[str, Any], bytes | bytearray]]:
    """The runner's requests, (header, payload) each, until ``close`` or the end of the pipe."""
    while True:
        try:
            header, payload = pipe.recv()
        except wire.Closed:
            return
        if header.get("op") == "close":
            return
        yield header, payload


def serve(pipe: wire.Pipe, adapter: Any) -> None:
    """Answer requests until ``close`` or the end of the pipe.

    ``supports``, ``run`` and ``backward`` get one reply; ``supports+run`` gets the
    answer of ``supports()`` at once and, if it is True, the reply of ``run()``
    after it (one round trip per case instead of two).  The first reply of a
    ``run()`` or ``backward()`` that returned carries this process's environment
    again (``environment``): what the adapter imported or set up while computing.
    """
    # the adapter's temporaries, however large, freed, are reused within the case and by the next one, in
    # pages of 4 KiB (mhaspec.allocator)
    keep_freed_pages(WORKER_MMAP_THRESHOLD, WORKER_TRIM_THRESHOLD)
    no_huge_page_advice()
    case: Case | None = None
    described = False
    for header, payload in requests(pipe):
        op = header.get("op")
        if op not in wire.OPS or op == "load":
            raise wire.Malformed(f"a request with op {op!r}")
        if not header.get("reuse"):
            case = wire.case_from_message(header["case"], payload)
        if case is None:
            raise wire.Malformed(f"a {op!r} request reusing a case before any case was sent")
        for step in op.split("+"):
            reply, data = call_adapter(adapter, step, case)
            if "seq" in header:
                reply["seq"] = header["seq"]  # which request this answers
            if step != "supports":
                release_freed_memory()  # the adapter's freed temporaries, not held while the reply is sent
            if not described and step != "supports" and reply["ok"]:
                reply["environment"] = describe_environment(process="worker")
                described = True
            pipe.send(reply, data)
            answered = reply["ok"] and reply.get("answer") is True
            del reply, data  # the adapter's arrays: sent, not held while the runner judges them
            if step != "supports":
                release_freed_memory()
            elif not answered:
                break


def load_and_serve(pipe: wire.Pipe, ref: str, options: Mapping[str, Any]) -> None:
    """Load the adapter named ``ref``, answer ``ready`` with its description (or the error), then serve."""
    try:
        adapter = load_adapter(ref, **options)
    except SystemExit as exc:
        pipe.send(wire.failure("ready", f"adapter called sys.exit({exc.code!r}) while being loaded"))
        return
    except AdapterError as exc:
        pipe.send(wire.failure("ready", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001
        pipe.send(wire.failure("ready", f"loading adapter {ref!r} failed: {describe_exception(exc)}"))
        return
    describe_and_serve(pipe, adapter)


def describe_and_serve(pipe: wire.Pipe, adapter: Any) -> None:
    """A loaded or inherited adapter object: describe it here, in the process where it computes (reading its
    ``known_deviations`` may run the framework, e.g. the TensorFlow adapters' probe), answer with the
    description (or the error) — the start-up is not counted in the first case's timeout — then serve."""
    try:
        info = describe_adapter(adapter)
    except AdapterError as exc:
        pipe.send(wire.failure("ready", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001
        pipe.send(wire.failure("ready", f"describing adapter {adapter_name(adapter)!r} failed: {describe_exception(exc)}"))
        return
    pipe.send(wire.ready(info, describe_environment(process="worker")))
    if is_distributed(adapter):  # one rank per thread (transports/threads_ranks.py)
        from .transports.threads_ranks import serve_ranks

        serve_ranks(pipe, adapter)
    else:
        serve(pipe, adapter)


def main(argv: list[str], then: Callable[[wire.Pipe, Mapping[str, Any]], None] | None = None) -> None:
    """Entry point of a spawned worker: ``READ_FD WRITE_FD PARENT_PID DIE_WITH_PARENT [SHARED_FD]`` (the socket
    of :class:`~mhaspec.protocol.wire.SharedMemory`); after the ``load`` request, ``then(pipe, request)``
    (default: load the named adapter and serve it)."""
    code = 0
    try:
        shared = wire.SharedMemory(socket.socket(fileno=int(argv[4]))) if len(argv) > 4 else None
        pipe = wire.Pipe(int(argv[0]), int(argv[1]), shared)
        detach_from_terminal_signals(int(argv[2]), argv[3] == "1")
        header, _ = pipe.recv()
        if header.get("op") != "load":
            raise wire.Malformed(f"a first request with op {header.get('op')!r}, not 'load'")
        try:
            wire.check_protocol(header, "the runner")
        except wire.ProtocolError as exc:
            pipe.send(wire.failure("ready", str(exc)))
            return
        sys.path[:] = header["sys_path"]
        if then is None:
            load_and_serve(pipe, header["adapter"], header["options"])
        else:
            then(pipe, header)
    except BaseException:  # noqa: BLE001 - a broken worker must still leave at once
        traceback.print_exc()
        code = EXIT_BROKEN
    finally:
        finish(code)


def run_forked(pipe: wire.Pipe, adapter: Any, options: Mapping[str, Any] | None, parent: int,
               die_with_parent: bool) -> None:
    """What a forked child runs: load the named adapter (``adapter`` a str) or keep the inherited
    object, then serve; never returns."""
    code = 0
    try:
        detach_from_terminal_signals(parent, die_with_parent)
        forget_golden()
        if isinstance(adapter, str):
            load_and_serve(pipe, adapter, options or {})
        else:
            describe_and_serve(pipe, adapter)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = EXIT_BROKEN
    finally:
        finish(code)


def detach_from_terminal_signals(parent: int, die_with_parent: bool) -> None:
    """Ctrl-C is the runner's to handle (it kills this worker); die when the runner dies (Linux)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(0)


def forget_golden() -> None:
    """In a forked worker: empty every golden fixture inherited from the runner's memory.

    A forked child starts as a copy of the runner, golden stages included; the
    adapter must find none of them (e.g. through ``gc``).  What the judging side
    derived from them (bounds, memos) it drops itself in a forked child
    (``os.register_at_fork``, in mhaspec.conformance.judging).
    """
    fixtures = sys.modules.get("mhaspec.fixtures")
    if fixtures is None:
        return
    import gc

    golden_types = (fixtures.GoldenSet, fixtures.GoldenCase)
    for obj in gc.get_objects():
        # type(obj), not isinstance: isinstance also asks obj.__class__, which some objects compute
        # (torch's deprecated-module proxies warn when asked); subclasses count (on-the-fly goldens)
        if issubclass(type(obj), golden_types):
            for name, value in list(vars(obj).items()):
                if isinstance(value, dict):
                    value.clear()  # GoldenSet._loaded, GoldenCase.stages/inputs/weights, caches
                elif isinstance(value, np.ndarray):
                    object.__setattr__(obj, name, None)  # GoldenCase.visible


def finish(code: int) -> None:
    """Leave at once: never wait for threads the adapter left behind."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
