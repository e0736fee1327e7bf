"""The adapter runs in a worker process; the runner keeps the golden.

A :class:`Worker` starts one process per session and reuses it for every case
(a framework is imported once).  The worker receives only what an adapter may
see — the :class:`~mhaspec.spec.Case` (config, dtype, inputs, weights) — and
sends back the adapter's mapping of stage -> array.  Whatever the adapter does
to its process (a segfault, ``os.abort()``, ``sys.exit()``, ``os._exit()``, a
hang in native code holding the GIL, a non-daemon thread left behind) costs
one case: the runner turns it into the verdict ``error`` naming the cause, and
the next case gets a fresh worker.  The per-case timeout is enforced by killing
the worker, so native code cannot escape it.

How the adapter reaches the worker:

- given by **name** (built-in name, ``module:attr``, ``file.py:attr``): a
  fresh interpreter is *spawned* and loads the adapter itself.  Nothing is
  inherited, so frameworks already imported in the caller (torch, TensorFlow,
  JAX threads) cannot deadlock it.
- given as a Python **object** (an instance or a class, e.g. in a test suite):
  the worker is *forked* and inherits the object as it is.  After a crash the
  next worker is forked again from the caller's pristine object.  If the caller
  has already started a framework's thread pools, a forked child may hang in
  them; the timeout then reports it — pass the adapter by name to avoid that.

Wire format (two pipes, never stdin/stdout, which stay the adapter's): each
message is ``<u64 header length><u64 payload length>``, a JSON header (small
control data), and a payload of safetensors bytes (the arrays: inputs and
weights one way, the returned stages the other).  Nothing is pickled.
bfloat16 (ml_dtypes) and float8 arrays travel as safetensors' BF16/F8 types.
The worker's first message (ready, with the adapter's description) and its
reply to the first ``run()`` also carry its ``environment``
(:func:`mhaspec.environment.describe`): reports say where the adapter computed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..adapters import adapter_dtypes, adapter_framework, adapter_name, load_adapter, parse_deviations
from ..environment import describe as describe_environment
from ..errors import AdapterError, MhaspecError
from ..spec import BACKWARD_STAGES, STAGES, Case, MHAConfig
from ..spec.case import Inputs, Weights

#: Seconds a spawned worker may take to import and construct the adapter.
LOAD_TIMEOUT = 120.0

_FRAME = struct.Struct("<QQ")

# numpy dtype name -> safetensors dtype code
_CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "bool": "BOOL",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
_NAMES = {code: name for name, code in _CODES.items()}


def validate_timeout(timeout: Any, where: str = "timeout") -> float | None:
    """Seconds as a float, None for no timeout (None or 0); anything else is a usage error."""
    if timeout is None:
        return None
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise MhaspecError(f"{where}: expected a number of seconds, got {timeout!r}") from None
    if not math.isfinite(value) or value < 0:
        raise MhaspecError(f"{where}: must be a finite number of seconds >= 0 (0 = no timeout), got {timeout!r}")
    return value or None


class CaseTimeout(Exception):
    """The adapter did not answer within the per-case timeout."""


class AdapterCrash(Exception):
    """The adapter raised, exited or killed its process; the message names the cause."""


# -- arrays as safetensors bytes -------------------------------------------------


def _dtype(name: str) -> Any:
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> bytes:
    """safetensors bytes of ``arrays`` (any dtype in ``_CODES``), little-endian."""
    header: dict[str, Any] = {}
    chunks = []
    offset = 0
    for name in sorted(arrays):
        array = np.asarray(arrays[name])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _CODES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def decode_arrays(data: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The arrays of :func:`encode_arrays` (read-only views of ``data``)."""
    if not data:
        return {}
    view = memoryview(data)
    n = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8 : 8 + n]))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _dtype(_NAMES[info["dtype"]])
        start, end = info["data_offsets"]
        count = (end - start) // dtype.itemsize
        out[name] = np.frombuffer(view, dtype=dtype, count=count, offset=base + start).reshape(info["shape"])
    return out


def _case_message(case: Case) -> tuple[dict[str, Any], bytes]:
    """A Case as a JSON header (its scalar fields, its config, which inputs are one array) and bytes.

    Generic over the Case's fields, so a field added to the spec travels too;
    an input that is the same array as another (self-attention, key = value)
    travels once and is the same array again on the other side.
    """
    scalars = {name: getattr(case, name) for name in type(case).model_fields
               if name not in ("config", "inputs", "weights", "d_output")}
    arrays: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name in type(case.inputs).model_fields:
        array = getattr(case.inputs, name)
        if array is None:
            continue
        if id(array) in first:
            aliases[name] = first[id(array)]
            continue
        first[id(array)] = name
        arrays[f"input.{name}"] = array
    arrays.update({f"weight.{k}": v for k, v in case.weights.as_dict().items()})
    if case.d_output is not None:
        arrays["grad.d_output"] = case.d_output
    header = {"scalars": scalars, "config": case.config.model_dump(mode="json"), "aliases": aliases}
    return header, encode_arrays(arrays)


def _case_from_message(header: Mapping[str, Any], payload: bytes) -> Case:
    arrays = decode_arrays(payload)  # read-only views of the payload
    inputs = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("input.")}
    for name, same_as in header["aliases"].items():
        inputs[name] = inputs[same_as]
    weights = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("weight.")}
    return Case(config=MHAConfig.model_validate(header["config"]), inputs=Inputs(**inputs), weights=Weights(**weights),
                d_output=arrays.get("grad.d_output"), **header["scalars"])


def _pack_returned(returned: Any) -> tuple[dict[str, Any], bytes]:
    """What ``run()`` returned, as a header (keys, stages that cannot travel as arrays) and bytes."""
    if not isinstance(returned, Mapping):
        return {"mapping": False, "type": type(returned).__name__}, b""
    arrays: dict[str, np.ndarray] = {}
    special: dict[str, Any] = {}
    for key, value in returned.items():
        if not (isinstance(key, str) and (key in STAGES or key in BACKWARD_STAGES)):
            continue  # the runner only needs the name to report it
        try:
            array = np.asarray(value)
        except Exception as exc:  # e.g. a tensor that requires grad
            special[key] = {"type": type(value).__name__, "error": str(exc)}
            continue
        if array.dtype.name in _CODES:
            arrays[key] = array
        else:  # complex, object, str ...: judged by dtype alone, so the dtype and shape suffice
            special[key] = {"dtype": array.dtype.str, "name": array.dtype.name, "shape": list(array.shape)}
    return {"mapping": True, "keys": [str(k) for k in returned], "special": special}, encode_arrays(arrays)


class _Unconvertible:
    """Stands for a returned value numpy could not convert in the worker."""

    def __init__(self, error: str) -> None:
        self._error = error

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(self._error)


def _unpack_returned(header: Mapping[str, Any], payload: bytes) -> Any:
    if not header["mapping"]:
        return type(header["type"], (), {})()  # an object of the same type name: judged as "not a mapping"
    arrays = decode_arrays(payload)
    out: dict[str, Any] = {}
    for key in header["keys"]:
        if key in arrays:
            out[key] = arrays[key]
        elif key in header["special"]:
            info = header["special"][key]
            if "error" in info:
                out[key] = type(info["type"], (_Unconvertible,), {})(info["error"])
            else:
                try:
                    dtype = _dtype(info["name"]) if info["name"].startswith(("bfloat", "float8")) else np.dtype(info["dtype"])
                except (TypeError, AttributeError, ImportError):
                    dtype = np.dtype(object)
                out[key] = np.zeros(info["shape"], dtype=dtype) if dtype != np.dtype(object) else np.empty(info["shape"], object)
        else:
            out[key] = None  # not a stage: reported by name
    return out


# -- the pipe ----------------------------------------------------------------------


class _WorkerDied(Exception):
    pass


class _Deadline(Exception):
    pass


class _Malformed(Exception):
    """Bytes on the pipe that are not a message of ours (e.g. an adapter writing to the worker's descriptors)."""


#: Bounds on one message: a header is a few KB; a payload holds one case's arrays.
MAX_HEADER = 1 << 24
MAX_PAYLOAD = 1 << 40


class _Pipe:
    """Framed messages over two file descriptors."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self._poller = select.poll()
        self._poller.register(read_fd, select.POLLIN)

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        text = json.dumps(header).encode("utf-8")
        data = memoryview(_FRAME.pack(len(text), len(payload)) + text + payload)
        try:
            while data:
                data = data[os.write(self.write_fd, data):]
        except OSError as exc:  # BrokenPipeError: the other side is gone
            raise _WorkerDied(str(exc)) from None

    def recv(self, deadline: float | None = None) -> tuple[dict[str, Any], bytes]:
        head = self._read(_FRAME.size, deadline)
        n_header, n_payload = _FRAME.unpack(head)
        if n_header > MAX_HEADER or n_payload > MAX_PAYLOAD:
            raise _Malformed(f"a message of {n_header} + {n_payload} bytes")
        try:
            header = json.loads(self._read(n_header, deadline))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Malformed(f"a header that is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise _Malformed("a header that is not a JSON object")
        return header, bytes(self._read(n_payload, deadline)) if n_payload else b""

    def _read(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._poller.poll(max(1, int(remaining * 1000) + 1)):
                    raise _Deadline()
            chunk = os.read(self.read_fd, min(n - got, 1 << 22))
            if not chunk:
                raise _WorkerDied("end of file")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        return buf

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


# -- the worker process ------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    """``Type: message (file:line in function)`` at the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def describe_adapter(adapter: Any) -> dict[str, Any]:
    """What the runner needs to know about an adapter, as JSON-able data."""
    name = adapter_name(adapter)
    deviations = parse_deviations(getattr(adapter, "known_deviations", None), f"adapter {name}: known_deviations")
    framework, version = adapter_framework(adapter)
    return {
        "name": name,
        "dtypes": list(adapter_dtypes(adapter)),
        "deviations": [dataclasses.asdict(d) for d in deviations],
        "framework": framework,
        "framework_version": version,
        "has_supports": getattr(adapter, "supports", None) is not None,
        "has_backward": callable(getattr(adapter, "backward", None)),
    }


def _call_adapter(adapter: Any, op: str, case: Case) -> tuple[dict[str, Any], bytes]:
    start = time.perf_counter()
    try:
        if op == "supports":
            answer = adapter.supports(case)
            return {"ok": True, "answer": answer if isinstance(answer, (bool, str)) else False}, b""
        returned = adapter.backward(case) if op == "backward" else adapter.run(case)
        header, payload = _pack_returned(returned)  # converting lazy arrays is part of the adapter's time
        header.update(ok=True, seconds=time.perf_counter() - start)
        return header, payload
    except SystemExit as exc:
        return {"ok": False, "error": f"adapter called sys.exit({exc.code!r}) in {op}()"}, b""
    except BaseException as exc:  # noqa: BLE001 - anything the adapter raises is its verdict
        return {"ok": False, "error": f"{op}() raised {_describe(exc)}"}, b""


def serve(pipe: _Pipe, adapter: Any) -> None:
    """Answer requests until ``close`` or the end of the pipe.

    ``supports`` and ``run`` get one reply; ``supports+run`` gets the answer of
    ``supports()`` at once and, if it is True, the reply of ``run()`` after it
    (one round trip per case instead of two).  The first reply of a ``run()`` or
    ``backward()`` that returned carries this process's environment again
    (``environment``): what the adapter imported or set up while computing.
    """
    case: Case | None = None
    described = False
    while True:
        try:
            header, payload = pipe.recv()
        except _WorkerDied:
            return
        op = header["op"]
        if op == "close":
            return
        if not header.get("reuse"):
            case = _case_from_message(header["case"], payload)
        assert case is not None
        for step in op.split("+"):
            reply, data = _call_adapter(adapter, step, case)
            if not described and step != "supports" and reply["ok"]:
                reply["environment"] = describe_environment(process="worker")
                described = True
            pipe.send(reply, data)
            if step == "supports" and not (reply["ok"] and reply["answer"] is True):
                break


def _detach_from_terminal_signals(parent: int, die_with_parent: bool) -> None:
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


def _forget_golden() -> None:
    """In a forked worker: empty every golden fixture inherited from the runner's memory.

    A forked child starts as a copy of the runner, golden stages included; the
    adapter must find none of them (e.g. through ``gc``).
    """
    fixtures = sys.modules.get("mhaspec.fixtures")
    if fixtures is None:
        return
    import gc

    fixtures.DERIVED.clear()  # the bounds kept for the process (GoldenCase.derived)
    for obj in gc.get_objects():
        if isinstance(obj, (fixtures.GoldenSet, fixtures.GoldenCase)):  # subclasses too (on-the-fly goldens)
            for name, value in list(vars(obj).items()):
                if isinstance(value, dict):
                    value.clear()  # GoldenSet._loaded, GoldenCase.stages/inputs/weights, caches
                elif isinstance(value, np.ndarray):
                    object.__setattr__(obj, name, None)  # GoldenCase.visible


def _finish(code: int) -> None:
    """Leave at once: never wait for threads the adapter left behind."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def _load_and_serve(pipe: _Pipe, ref: str, options: Mapping[str, Any]) -> None:
    """Load the adapter named ``ref``, answer with its description (or the error), then serve."""
    try:
        adapter = load_adapter(ref, **options)
        info = describe_adapter(adapter)
    except SystemExit as exc:
        pipe.send({"ok": False, "error": f"adapter called sys.exit({exc.code!r}) while being loaded"})
        return
    except AdapterError as exc:
        pipe.send({"ok": False, "error": str(exc)})
        return
    except BaseException as exc:  # noqa: BLE001
        pipe.send({"ok": False, "error": f"loading adapter {ref!r} failed: {_describe(exc)}"})
        return
    pipe.send({"ok": True, **info, "environment": describe_environment(process="worker")})
    serve(pipe, adapter)


def _describe_and_serve(pipe: _Pipe, adapter: Any) -> None:
    """An inherited adapter object: describe it here, in the process where it computes (reading its
    ``known_deviations`` may run the framework, e.g. the TensorFlow adapters' probe), answer with the
    description (or the error) — the start-up is not counted in the first case's timeout — then serve."""
    try:
        info = describe_adapter(adapter)
    except AdapterError as exc:
        pipe.send({"ok": False, "error": str(exc)})
        return
    except BaseException as exc:  # noqa: BLE001
        pipe.send({"ok": False, "error": f"describing adapter {adapter_name(adapter)!r} failed: {_describe(exc)}"})
        return
    pipe.send({"ok": True, **info, "environment": describe_environment(process="worker")})
    serve(pipe, adapter)


def main(argv: list[str]) -> None:
    """Entry point of a spawned worker: ``READ_FD WRITE_FD PARENT_PID DIE_WITH_PARENT``."""
    code = 0
    try:
        pipe = _Pipe(int(argv[0]), int(argv[1]))
        _detach_from_terminal_signals(int(argv[2]), argv[3] == "1")
        header, _ = pipe.recv()
        sys.path[:] = header["sys_path"]
        _load_and_serve(pipe, header["adapter"], header["options"])
    except BaseException:  # noqa: BLE001 - a broken worker must still leave at once
        traceback.print_exc()
        code = 70
    finally:
        _finish(code)


#: Modules whose threads or device state a forked child may inherit in a broken state.
FRAMEWORKS = frozenset({"torch", "tensorflow", "jax", "jaxlib", "keras", "flax", "onnxruntime", "cupy", "numba",
                        "triton", "tensorrt", "mxnet", "paddle", "tvm"})


def start_method(by_name: bool) -> str:
    """``fork`` or ``spawn`` for a new worker.

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


# -- the runner's side ---------------------------------------------------------------


def _death_cause(status: int | None) -> str:
    if status is None:
        return "worker process stopped answering"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"worker killed by {name}"
    return f"worker exited with status {status} without answering (os._exit or an exit from native code)"


class _Process:
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


def _reap(process: _Process, pipe: _Pipe) -> None:
    pipe.close()
    process.kill()


class Worker:
    """One adapter in its own process, restarted after a crash.

    ``adapter`` is a name (spawned worker loads it) or an already loaded
    adapter object (forked worker inherits it).
    """

    def __init__(self, adapter: Any, options: Mapping[str, Any] | None = None, load_timeout: float = LOAD_TIMEOUT) -> None:
        self._ref = adapter
        self._options = {k: v for k, v in (options or {}).items() if v is not None}
        self._load_timeout = load_timeout
        self._by_name = isinstance(adapter, str)
        if not self._by_name and not hasattr(os, "fork"):
            raise AdapterError("isolation of an adapter object needs fork(); pass the adapter by name or use isolate=False")
        self._process: _Process | None = None
        self._pipe: _Pipe | None = None
        # The Case the current worker already holds, and the replies on their way, by the Case *object*
        # (held here, so that its id() cannot be reused by another Case: case ids repeat, e.g. in fuzz).
        self._sent: Case | None = None
        self._expect: collections.deque[tuple[str, Case]] = collections.deque()
        #: The adapter's description, as its worker sends it (described where it computes: its
        #: known_deviations may measure the framework, which must not start in this process before a fork).
        self.info: dict[str, Any] | None = None
        #: The worker process's environment (:func:`mhaspec.environment.describe`), as it last sent it:
        #: once loaded, then again after the adapter's first run() (None until a worker answered).
        self.environment: dict[str, Any] | None = None
        self._finalizer: weakref.finalize | None = None
        self._ready = False
        self.restarts = 0
        #: Called after each run() reply is read (the runner sends the next case ahead).
        self.on_idle: Callable[[], None] | None = None

    # -- lifecycle --
    def start(self) -> None:
        """Start the process (a spawned one gets the load request, answered in :meth:`wait_loaded`)."""
        if self._process is not None:
            return
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        die_with_parent = threading.current_thread() is threading.main_thread()
        spawn = start_method(self._by_name) == "spawn"
        if spawn:
            root = str(Path(__file__).resolve().parents[2])
            code = f"import sys; sys.path.insert(0, {root!r}); from mhaspec.conformance.worker import main; main(sys.argv[1:])"
            args = [sys.executable, "-c", code, str(to_child_r), str(to_parent_w), str(os.getpid()), "1" if die_with_parent else "0"]
            try:
                popen = subprocess.Popen(args, pass_fds=(to_child_r, to_parent_w))
            except OSError as exc:
                for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
                    os.close(fd)
                raise AdapterError(f"cannot start a worker process ({exc})") from None
            process = _Process(popen=popen)
        else:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:  # the child: load the named adapter or keep the inherited object; never return
                code_ = 0
                try:
                    os.close(to_child_w)
                    os.close(to_parent_r)
                    _detach_from_terminal_signals(parent, die_with_parent)
                    _forget_golden()
                    pipe = _Pipe(to_child_r, to_parent_w)
                    if self._by_name:
                        _load_and_serve(pipe, self._ref, self._options)
                    else:
                        _describe_and_serve(pipe, self._ref)
                except BaseException:  # noqa: BLE001
                    traceback.print_exc()
                    code_ = 70
                finally:
                    _finish(code_)
            process = _Process(pid=pid)
        os.close(to_child_r)
        os.close(to_parent_w)
        self._process, self._pipe = process, _Pipe(to_parent_r, to_child_w)
        self._sent = None
        self._expect.clear()
        self._ready = False
        self._finalizer = weakref.finalize(self, _reap, process, self._pipe)
        if spawn:
            self._pipe.send({"adapter": self._ref, "options": self._options, "sys_path": list(sys.path)})

    def wait_loaded(self) -> dict[str, Any]:
        """Start if needed and return the adapter's description; a failure to load is an AdapterError."""
        self.start()
        if self._ready:
            return self.info  # type: ignore[return-value]
        assert self._pipe is not None and self._process is not None
        try:
            reply, _ = self._pipe.recv(time.monotonic() + self._load_timeout)
        except _Deadline:
            self._discard()
            raise AdapterError(f"adapter {self._ref!r}: loading it took more than {self._load_timeout:g} s") from None
        except _WorkerDied:
            cause = _death_cause(self._process.poll(wait=2.0))
            self._discard()
            raise AdapterError(f"adapter {self._ref!r}: {cause} while loading the adapter") from None
        except _Malformed as exc:
            self._discard()
            raise AdapterError(f"adapter {self._ref!r}: the worker sent {exc} while loading the adapter") from None
        if not reply["ok"]:
            self._discard()
            raise AdapterError(reply["error"])
        self.environment = reply.pop("environment", None) or self.environment
        self.info = {k: v for k, v in reply.items() if k != "ok"}
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
            self._pipe.send({"op": "close"})
        except _WorkerDied:
            pass
        self._process.poll(wait=1.0)
        self._discard()

    # -- requests --
    def _request(self, op: str, case: Case, timeout: float | None) -> tuple[dict[str, Any], bytes]:
        """Read the reply of ``op`` for ``case``, sending the request first unless it is already on its way
        (``run`` after ``supports+run``, or a case sent ahead by :meth:`prefetch`)."""
        if self._expect and self._expect[0][0] == op and self._expect[0][1] is case:
            self._expect.popleft()
            return self._reply(op, case, timeout)
        if self._expect or (self._process is not None and self._process.poll() is not None):
            self._discard()  # replies nobody will read (the plan changed), or a worker that died between cases
        if self._process is None:
            self.restarts += self.info is not None
            try:
                self.wait_loaded()
            except AdapterError as exc:
                raise AdapterCrash(f"the worker could not be restarted: {exc}") from None
        self._send(case, with_supports=op == "supports", then="backward" if op == "backward" else "run")
        self._expect.popleft()
        return self._reply(op, case, timeout)

    def _send(self, case: Case, with_supports: bool, then: str = "run") -> None:
        """Send ``case`` with the op ``then`` (``run`` or ``backward``), after ``supports`` if asked."""
        assert self._pipe is not None
        wire = f"supports+{then}" if with_supports else then
        try:
            if self._sent is case:
                self._pipe.send({"op": wire, "reuse": True})
            else:
                header, payload = _case_message(case)
                self._pipe.send({"op": wire, "case": header}, payload)
                self._sent = case
        except _WorkerDied:
            pass  # the reply tells how it died
        self._expect.extend([("supports", case), (then, case)] if with_supports else [(then, case)])

    def prefetch(self, case: Case, with_supports: bool) -> None:
        """Send ``case`` ahead, so the worker computes it while the runner judges the previous one.

        Only when every reply has been read: at most one request is in flight, so
        neither side can block the other on a full pipe.  Its timeout starts when
        the runner asks for the reply (so it is never shorter than asked).
        """
        if self._expect or not self._ready or self._process is None or self._process.poll() is not None:
            return
        self._send(case, with_supports)

    def _reply(self, op: str, case: Case, timeout: float | None) -> tuple[dict[str, Any], bytes]:
        assert self._pipe is not None and self._process is not None
        try:
            reply, data = self._pipe.recv(None if not timeout else time.monotonic() + timeout)
        except _Deadline:
            self._discard()
            raise CaseTimeout(
                f"the adapter did not return within {timeout:g} s (per-case timeout) in {op}(); "
                "its worker process was killed"
            ) from None
        except _WorkerDied:
            cause = _death_cause(self._process.poll(wait=2.0))
            self._discard()
            raise AdapterCrash(f"{cause} during {op}()") from None
        except _Malformed as exc:
            self._discard()
            raise AdapterCrash(f"the worker sent {exc} during {op}() (did the adapter write to its pipe?); "
                               "worker process killed") from None
        if isinstance(reply.get("environment"), dict):
            self.environment = reply.pop("environment")  # the first run() of this process
        if op == "supports" and not (reply.get("ok") is True and reply.get("answer") is True):
            if self._expect and self._expect[0][0] == "run" and self._expect[0][1] is case:
                self._expect.popleft()  # the worker does not run a case it does not support
        if reply.get("ok") is not True:
            raise AdapterCrash(str(reply.get("error", f"the worker sent a malformed reply during {op}()")))
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

    def _returned(self, op: str, case: Case, timeout: float | None) -> tuple[Any, float]:
        reply, data = self._request(op, case, timeout)
        if op == "run" and self.on_idle is not None:
            self.on_idle()  # e.g. send the next case ahead: the worker computes it while this one is judged
        try:
            return _unpack_returned(reply, data), float(reply["seconds"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self._discard()
            raise AdapterCrash(f"the worker sent a malformed reply during {op}() ({type(exc).__name__}: {exc}); "
                               "worker process killed") from None


class InProcess:
    """The adapter called in this process (``isolate=False``): for debugging with a debugger.

    The timeout is a daemon thread that is abandoned, not killed: native code
    holding the GIL escapes it, and a crash of the adapter ends the run.
    """

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.info = describe_adapter(adapter)
        self.restarts = 0

    @property
    def environment(self) -> dict[str, Any]:
        """This process's environment: the adapter computes here."""
        return describe_environment(process="in-process")

    def supports(self, case: Case, timeout: float | None) -> bool | str:
        return self._call("supports", lambda: self.adapter.supports(case), timeout)

    def run(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        start = time.perf_counter()
        returned = self._call("run", lambda: self.adapter.run(case), timeout)
        return returned, time.perf_counter() - start

    def backward(self, case: Case, timeout: float | None) -> tuple[Any, float]:
        start = time.perf_counter()
        returned = self._call("backward", lambda: self.adapter.backward(case), timeout)
        return returned, time.perf_counter() - start

    def close(self) -> None:
        pass

    @staticmethod
    def _call(op: str, fn: Callable[[], Any], timeout: float | None) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        if not timeout:
            target()
        else:
            thread = threading.Thread(target=target, name="mhaspec-case", daemon=True)
            thread.start()
            thread.join(timeout)
            if thread.is_alive():
                raise CaseTimeout(f"the adapter did not return within {timeout:g} s (per-case timeout)")
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, SystemExit):
                raise AdapterCrash(f"adapter called sys.exit({exc.code!r}) in {op}()")
            if isinstance(exc, KeyboardInterrupt):
                raise exc
            raise AdapterCrash(f"{op}() raised {_describe(exc)}")
        return box.get("value")
