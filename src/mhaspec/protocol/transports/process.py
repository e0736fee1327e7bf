"""The adapter in a worker process that speaks ``mhaspec-wire/1``; the runner keeps the golden.

:class:`ProcessTransport` is the runner's side of the wire: it reads the worker's
``ready`` (refusing another protocol version), sends cases, reads replies with a
deadline, and turns whatever happens to the process into one case's error.  How
the process is started is a subclass's :meth:`~ProcessTransport._launch`:
:class:`Worker` forks or spawns a Python worker (mhaspec.protocol.worker); an
executable (``exec:PROGRAM``) or a group of ranks is another subclass.

A process serves every case of a session (a framework is imported once).
Whatever the adapter does to it (a segfault, ``os.abort()``, ``sys.exit()``,
``os._exit()``, a hang in native code holding the GIL, a non-daemon thread left
behind) costs one case: the verdict ``error`` names the cause, and the next case
gets a fresh process.  The per-case timeout is enforced by killing the process,
so native code cannot escape it.

How a Python adapter reaches its worker (:class:`Worker`):

- given by **name** (built-in name, ``module:attr``, ``file.py:attr``): the worker
  loads it itself — *spawned* as a fresh interpreter (nothing inherited: frameworks
  already imported in the caller cannot deadlock it), or *forked* when that is
  safe (:func:`start_method`).
- given as a Python **object** (an instance or a class, e.g. in a test suite): the
  worker is *forked* and inherits the object as it is; after a crash the next one
  is forked again from the caller's pristine object.  If the caller has already
  started a framework's thread pools, a forked child may hang in them; the timeout
  then reports it — pass the adapter by name to avoid that.
"""

from __future__ import annotations

import abc
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import AdapterError
from ...spec import Case
from .. import wire, worker
from .base import AdapterCrash, CaseTimeout, Transport

#: Seconds a worker may take to import and construct the adapter.
LOAD_TIMEOUT = 120.0

#: Modules whose threads or device state a forked child may inherit in a broken state.
FRAMEWORKS = frozenset({"torch", "tensorflow", "jax", "jaxlib", "keras", "flax", "onnxruntime", "cupy", "numba",
                        "triton", "tensorrt", "mxnet", "paddle", "tvm"})


def start_method(by_name: bool) -> str:
    """``fork`` or ``spawn`` for a new Python worker.

    An adapter given by name is loaded in the worker; the worker is forked when
    that is safe — this process runs one thread and has imported no ML framework
    (the CLI never does) — which saves the new interpreter's imports, and spawned
    otherwise.  An adapter object can only be inherited: fork.  The environment
    variable ``MHASPEC_WORKER_START=spawn|fork`` overrides the choice for names.
    """
    if not by_name:
        return "fork"
    forced = os.environ.get("MHASPEC_WORKER_START", "auto")
    if forced in ("spawn", "fork"):
        return forced
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return "spawn"
    loaded = {name.partition(".")[0] for name in list(sys.modules)}
    return "spawn" if loaded & FRAMEWORKS else "fork"


def death_cause(status: int | None) -> str:
    if status is None:
        return "worker process stopped answering"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"worker killed by {name}"
    return f"worker exited with status {status} without answering (os._exit or an exit from native code)"


class Process:
    """A worker process, spawned (``Popen``) or forked (a pid)."""

    def __init__(self, popen: subprocess.Popen | None = None, pid: int | None = None) -> None:
        self.popen, self.pid = popen, (popen.pid if popen is not None else pid)
        self.status: int | None = None

    def poll(self, wait: float = 0.0) -> int | None:
        """The exit status (negative: killed by that signal), waiting up to ``wait`` seconds."""
        end = time.monotonic() + wait
        while self.status is None:
            if self.popen is not None:
                self.status = self.popen.poll()
            else:
                try:
                    pid, raw = os.waitpid(self.pid, os.WNOHANG)  # type: ignore[arg-type]
                except ChildProcessError:
                    self.status = -signal.SIGKILL
                    break
                if pid:
                    self.status = os.waitstatus_to_exitcode(raw)
            if self.status is None:
                if time.monotonic() >= end:
                    break
                time.sleep(0.005)
        return self.status

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # type: ignore[arg-type]
            except ProcessLookupError:
                pass
            self.poll(wait=5.0)


def _reap(process: Process, pipe: wire.Pipe) -> None:
    pipe.close()
    process.kill()


class ProcessTransport(Transport):
    """The runner's side of the wire to one worker process, replaced after a crash.

    ``label`` names the adapter in errors (``adapter LABEL: …``).  A subclass starts the process
    (:meth:`_launch`); everything after that is the protocol.
    """

    def __init__(self, label: str, load_timeout: float = LOAD_TIMEOUT) -> None:
        self.label = label
        self._load_timeout = load_timeout
        self._process: Process | None = None
        self._pipe: wire.Pipe | None = None
        # The Case the current worker already holds, and the replies on their way, by the Case *object*
        # (weakly for the one held: a Case the caller dropped is freed, and a dead reference matches no
        # new Case, whose id() may be the same: case ids repeat, e.g. in fuzz).
        self._sent: weakref.ref[Case] | None = None
        self._expect: collections.deque[tuple[str, Case, int]] = collections.deque()  # (step, case, seq)
        self._seq = 0  # the number of the last request sent (a reply echoes it: docs/protocol.md §3)
        #: The adapter's description, as its worker sends it in ``ready`` (described where it computes:
        #: its known_deviations may measure the framework, which must not start here before a fork).
        self.info: dict[str, Any] | None = None
        #: The worker process's environment, as it last sent it: in ``ready``, then again with the
        #: adapter's first run() reply (None until a worker answered).
        self.environment: dict[str, Any] | None = None
        self._finalizer: weakref.finalize | None = None
        self._ready = False
        self.restarts = 0
        self.on_idle = None

    @abc.abstractmethod
    def _launch(self) -> tuple[Process, wire.Pipe]:
        """Start a worker process; return it and the runner's end of its pipes (after any first request)."""

    def _described(self, environment: Any) -> dict[str, Any] | None:
        """The environment to keep from what the worker sent (mhaspec's worker: its own describe())."""
        return environment if isinstance(environment, dict) else None

    # -- lifecycle --
    def start(self) -> None:
        """Start the process (its ``ready`` is read in :meth:`wait_loaded`)."""
        if self._process is not None:
            return
        process, pipe = self._launch()
        self._process, self._pipe = process, pipe
        self._sent = None
        self._expect.clear()
        self._ready = False
        self._finalizer = weakref.finalize(self, _reap, process, pipe)

    def wait_loaded(self) -> dict[str, Any]:
        """Start if needed and return the adapter's description; a failure to load is an AdapterError."""
        self.start()
        if self._ready:
            return self.info  # type: ignore[return-value]
        assert self._pipe is not None and self._process is not None
        try:
            reply, _ = self._pipe.recv(time.monotonic() + self._load_timeout)
            wire.check_protocol(reply)  # first: a worker of another version may send another kind of ready
            wire.check_reply(reply, "ready")
        except wire.Deadline:
            self._discard()
            raise AdapterError(f"adapter {self.label}: loading it took more than {self._load_timeout:g} s") from None
        except wire.Closed:
            cause = death_cause(self._process.poll(wait=2.0))
            self._discard()
            raise AdapterError(f"adapter {self.label}: {cause} while loading the adapter") from None
        except wire.Malformed as exc:
            self._discard()
            raise AdapterError(f"adapter {self.label}: the worker sent {exc} while loading the adapter") from None
        except wire.ProtocolError as exc:
            self._discard()
            raise AdapterError(f"adapter {self.label}: {exc}") from None
        if not reply["ok"]:
            self._discard()
            raise AdapterError(reply["error"])
        self.environment = self._described(reply.pop("environment", None)) or self.environment
        try:
            self.info = wire.check_ready(reply)
        except wire.Malformed as exc:
            self._discard()
            raise AdapterError(f"adapter {self.label}: the worker sent {exc}") from None
        self._ready = True
        return self.info

    def _discard(self) -> None:
        """Kill the current process (if any); the next request starts a fresh one."""
        if self._finalizer is not None:
            self._finalizer()
        self._process = self._pipe = None
        self._sent = None
        self._expect.clear()
        self._ready = False

    def close(self) -> None:
        """Ask the worker to leave, then make sure it did."""
        if self._process is None or self._pipe is None:
            return
        try:
            self._pipe.send(wire.close_request())
        except wire.Closed:
            pass
        self._process.poll(wait=1.0)
        self._discard()

    # -- requests --
    def _request(self, op: str, case: Case, timeout: float | None) -> tuple[dict[str, Any], bytes]:
        """Read the reply of ``op`` for ``case``, sending the request first unless it is already on its way
        (``run`` after ``supports+run``, or a case sent ahead by :meth:`prefetch`)."""
        if self._expect and self._expect[0][0] == op and self._expect[0][1] is case:
            return self._reply(op, case, timeout, self._expect.popleft()[2])
        self._fresh_worker()
        self._send(case, with_supports=op == "supports", then=_then(op, case))
        return self._reply(op, case, timeout, self._expect.popleft()[2])

    def _fresh_worker(self) -> None:
        """A worker with no reply on its way, restarted if it died (:class:`AdapterCrash` if it cannot be)."""
        if self._expect or (self._process is not None and self._process.poll() is not None):
            self._discard()  # replies nobody will read (the plan changed), or a worker that died between cases
        if self._process is None:
            self.restarts += self.info is not None
            try:
                self.wait_loaded()
            except AdapterError as exc:
                raise AdapterCrash(f"the worker could not be restarted: {exc}") from None

    def _send(self, case: Case, with_supports: bool, then: str = "run") -> None:
        """Send ``case`` with the step ``then`` (``run``, ``backward`` or ``decode``), after ``supports`` if asked."""
        assert self._pipe is not None
        op = f"supports+{then}" if with_supports else then
        self._seq += 1
        seq = self._seq
        try:
            if self._sent is not None and self._sent() is case:
                self._pipe.send(wire.reuse_request(op, seq))
            else:
                self._pipe.send(*wire.case_request(op, case, seq))
                self._sent = weakref.ref(case)
        except wire.Closed:
            pass  # the reply tells how it died
        self._expect.extend([("supports", case, seq), (then, case, seq)] if with_supports else [(then, case, seq)])

    def prefetch(self, case: Case, with_supports: bool) -> None:
        """Send ``case`` ahead, so the worker computes it while the runner judges the previous one.

        Only when every reply has been read: at most one request is in flight, so
        neither side can block the other on a full pipe.  Its timeout starts when
        the runner asks for the reply (so it is never shorter than asked).
        """
        if self._expect or not self._ready or self._process is None or self._process.poll() is not None:
            return
        self._send(case, with_supports, then=_then("run", case))

    def _reply(self, op: str, case: Case, timeout: float | None, seq: int) -> tuple[dict[str, Any], bytes]:
        assert self._pipe is not None and self._process is not None
        try:
            reply, data = self._pipe.recv(None if not timeout else time.monotonic() + timeout)
            wire.check_reply(reply, op, seq)
        except wire.Deadline:
            self._discard()
            raise CaseTimeout(
                f"the adapter did not return within {timeout:g} s (per-case timeout) in {op}(); "
                "its worker process was killed"
            ) from None
        except wire.Closed as exc:
            cause = death_cause(self._process.poll(wait=2.0))
            if "middle" in str(exc):
                cause += ", in the middle of its reply (a partial write)"
            self._discard()
            raise AdapterCrash(f"{cause} during {op}()") from None
        except wire.Malformed as exc:
            self._discard()
            raise AdapterCrash(f"the worker sent {exc} during {op}() (did the adapter write to its pipe?); "
                               "worker process killed") from None
        if isinstance(reply.get("environment"), dict):
            self.environment = self._described(reply.pop("environment"))  # the first run() of this process
        if op == "supports" and not (reply["ok"] is True and reply.get("answer") is True):
            if self._expect and self._expect[0][0] in ("run", "decode") and self._expect[0][1] is case:
                self._expect.popleft()  # the worker does not run a case it does not support
        if reply["ok"] is not True:
            raise AdapterCrash(str(reply["error"]))
        return reply, data

    def supports(self, case: Case, timeout: float | None) -> bool | str:
        """The answer of ``supports(case)``; if it is True, ``run(case)`` has already started in the worker."""
        reply, _ = self._request("supports", case, timeout)
        return reply["answer"]

    def run(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``run(case)`` returned, seconds it took in the worker)."""
        return self._returned("run", case, timeout)

    def backward(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``backward(case)`` returned, seconds it took in the worker)."""
        return self._returned("backward", case, timeout)

    def decode(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        """(what ``decode(case)`` returned, one mapping per call, seconds it took in the worker)."""
        return self._returned("decode", case, timeout)

    def _returned(self, op: str, case: Case, timeout: float | None) -> tuple[Any, float]:
        reply, data = self._request(op, case, timeout)
        if op in ("run", "decode") and self.on_idle is not None:
            self.on_idle()  # e.g. send the next case ahead: the worker computes it while this one is judged
        try:
            unpack = wire.unpack_decoded if op == "decode" else wire.unpack_returned
            return unpack(reply, data), float(reply["seconds"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self._discard()
            raise AdapterCrash(f"the worker sent a malformed reply during {op}() ({type(exc).__name__}: {exc}); "
                               "worker process killed") from None


def _then(op: str, case: Case) -> str:
    """The step a request for ``op`` on ``case`` runs: ``backward`` or ``decode`` as asked; after ``supports``
    (or sent ahead), ``decode`` for a case with a schedule (whose ``run()`` is never called), else ``run``."""
    if op in ("backward", "decode"):
        return op
    return "decode" if case.schedule is not None else "run"


class Worker(ProcessTransport):
    """A Python adapter in a worker process: ``adapter`` is a name (the worker loads it; spawned, or
    forked when safe) or an already loaded adapter object (a forked worker inherits it)."""

    def __init__(self, adapter: Any, options: Mapping[str, Any] | None = None, load_timeout: float = LOAD_TIMEOUT) -> None:
        super().__init__(repr(adapter), load_timeout)
        self._ref = adapter
        self._options = {k: v for k, v in (options or {}).items() if v is not None}
        self._by_name = isinstance(adapter, str)
        if not self._by_name and not hasattr(os, "fork"):
            raise AdapterError("isolation of an adapter object needs fork(); pass the adapter by name or use isolate=False")

    @property
    def adapter_ref(self) -> Any:
        """The adapter as given: its name, or the adapter object."""
        return self._ref

    def _launch(self) -> tuple[Process, wire.Pipe]:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        shared, theirs = wire.SharedMemory.pair() or (None, None)  # large payloads beside the pipes (wire.py)
        die_with_parent = threading.current_thread() is threading.main_thread()
        try:
            if start_method(self._by_name) == "spawn":
                process = self._spawn(to_child_r, to_child_w, to_parent_r, to_parent_w, die_with_parent, theirs)
            else:
                process = self._fork(to_child_r, to_child_w, to_parent_r, to_parent_w, die_with_parent, theirs, shared)
        except BaseException:
            if shared is not None:
                shared.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()
        os.close(to_child_r)
        os.close(to_parent_w)
        pipe = wire.Pipe(to_parent_r, to_child_w, shared)
        if process.popen is not None:  # a spawned worker learns its adapter from the first request
            pipe.send(wire.load_request(self._ref, self._options, list(sys.path)))
        return process, pipe

    @staticmethod
    def _spawn(to_child_r: int, to_child_w: int, to_parent_r: int, to_parent_w: int, die_with_parent: bool,
               shared: socket.socket | None) -> Process:
        root = str(Path(__file__).resolve().parents[3])
        code = f"import sys; sys.path.insert(0, {root!r}); from mhaspec.protocol.worker import main; main(sys.argv[1:])"
        args = [sys.executable, "-c", code, str(to_child_r), str(to_parent_w), str(os.getpid()),
                "1" if die_with_parent else "0", *([str(shared.fileno())] if shared is not None else [])]
        try:
            popen = subprocess.Popen(args, pass_fds=(to_child_r, to_parent_w,
                                                     *([shared.fileno()] if shared is not None else [])))
        except OSError as exc:
            for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
                os.close(fd)
            raise AdapterError(f"cannot start a worker process ({exc})") from None
        return Process(popen=popen)

    def _fork(self, to_child_r: int, to_child_w: int, to_parent_r: int, to_parent_w: int,
              die_with_parent: bool, theirs: socket.socket | None, mine: wire.SharedMemory | None) -> Process:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: load the named adapter or keep the inherited object; never returns
            try:
                os.close(to_child_w)
                os.close(to_parent_r)
                if mine is not None:
                    mine.close()
                shared = wire.SharedMemory(theirs) if theirs is not None else None
                worker.run_forked(wire.Pipe(to_child_r, to_parent_w, shared), self._ref, self._options, parent,
                                  die_with_parent)  # leaves with os._exit
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            os._exit(worker.EXIT_BROKEN)
        return Process(pid=pid)
