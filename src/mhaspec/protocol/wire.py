"""``mhaspec-wire/1``: the messages between the runner and a worker process (docs/protocol.md).

Two pipes, one each way.  Every message is one frame::

    <u64 little-endian H> <u64 little-endian P> <H bytes: a JSON object, UTF-8> <P bytes: safetensors>

The JSON header says what the message is (``op`` in a request, ``reply`` in a
reply) and carries the small data; the payload carries the arrays — a case's
inputs and weights one way, the stages an adapter returned the other — as
safetensors bytes (:mod:`mhaspec.io.safetensors`; P = 0: no arrays).  Nothing
is pickled.  The worker's first message, ``ready``, carries ``"protocol":
"mhaspec-wire/1"``; a runner refuses any other version (:func:`check_protocol`).
The JSON Schema of every header is ``schema/messages.schema.json`` beside this file.

Between mhaspec's own runner and Python worker only (never an exec client), a large
payload may travel through shared memory instead (:class:`SharedMemory`): the same
frame, its payload left out of the pipe and written to an anonymous memory file
whose descriptor goes ahead of the frame over a Unix socket beside the pipes.

This module is language-neutral framing and message construction; which process
runs the adapter, and how, is :mod:`mhaspec.protocol.transports`.
"""

from __future__ import annotations

import array
import json
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..io import safetensors
from ..spec import DTYPES, REGISTRY, Case, MHAConfig
from ..spec.case import Inputs, Weights
from ..spec.variants import VARIANTS

#: The version of this protocol, sent in the worker's ``ready`` (and the runner's ``load``).
PROTOCOL = "mhaspec-wire/1"

#: The 16 bytes before every header: its length and the payload's, little-endian u64.
FRAME = struct.Struct("<QQ")

#: Bounds on one message: a header is a few KB; a payload holds one case's arrays.
MAX_HEADER = 1 << 24
MAX_PAYLOAD = 1 << 40

#: The steps a request may ask for, in the order a combined op runs them.  ``decode`` (a case with a
#: schedule, docs/serving.md) is asked only of mhaspec's own Python worker: an exec client is never sent it.
STEPS = ("supports", "run", "backward", "decode")
#: Every request ``op``: ``load`` (only to mhaspec's own Python worker, first), a step, a step after
#: ``supports`` (one round trip per case), ``close``.
OPS = ("load", "supports", "run", "backward", "decode", "supports+run", "supports+backward", "supports+decode", "close")
#: Every reply kind (``reply``): ``ready`` (the worker's first message), or the step it answers.
REPLIES = ("ready", *STEPS)


class Closed(Exception):
    """The other side is gone (end of file, or a broken pipe)."""


class Deadline(Exception):
    """No complete message arrived in time."""


class Malformed(Exception):
    """Bytes on the pipe that are not a message of this protocol (e.g. an adapter writing to the worker's descriptors)."""


class ProtocolError(Exception):
    """The other side speaks another version of the protocol (or says none)."""


# -- framing ---------------------------------------------------------------------------


class Pipe:
    """Framed messages over two file descriptors: ``read_fd`` from the other side, ``write_fd`` to it;
    with ``shared`` (:class:`SharedMemory`), large payloads through shared memory both ways."""

    def __init__(self, read_fd: int, write_fd: int, shared: SharedMemory | None = None) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.shared = shared
        self._poller = select.poll()
        self._poller.register(read_fd, select.POLLIN)

    def send(self, header: Mapping[str, Any], payload: bytes | safetensors.Parts = b"") -> None:
        """Write one frame; :class:`Closed` if the other side is gone.  A payload given as
        :class:`~mhaspec.io.safetensors.Parts` is written buffer by buffer, never joined into one copy."""
        text = json.dumps(header).encode("utf-8")
        buffers = payload.buffers if isinstance(payload, safetensors.Parts) else [memoryview(payload)]
        try:
            if self.shared is not None and self.shared.carries(buffers):
                buffers = []  # the payload went ahead: only the frame and header follow on the pipe
            for data in (memoryview(FRAME.pack(len(text), len(payload)) + text), *buffers):
                write_all(self.write_fd, data)
        except OSError as exc:  # BrokenPipeError: the other side is gone
            raise Closed(str(exc)) from None

    def recv(self, deadline: float | None = None) -> tuple[dict[str, Any], bytes | bytearray]:
        """Read one frame: (header, payload); :class:`Deadline` past ``deadline`` (time.monotonic()),
        :class:`Closed` at the end of the pipe, :class:`Malformed` for bytes that are not a frame.
        The payload is read straight into one buffer, which it is (not copied again)."""
        n_header, n_payload = FRAME.unpack(self._read(FRAME.size, deadline))
        check_lengths(n_header, n_payload)
        try:
            header = decode_header(self._read(n_header, deadline))
            if not n_payload:
                return header, b""
            received = self.shared.receive(n_payload) if self.shared is not None else None
            return header, received if received is not None else self._read(n_payload, deadline)
        except Closed:
            raise Closed("end of file in the middle of a message") from None

    def _read(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._poller.poll(max(1, int(remaining * 1000) + 1)):
                    raise Deadline()
            count = os.readv(self.read_fd, [view[got:]])  # into the buffer itself
            if not count:
                raise Closed("end of file" if not got else "end of file in the middle of a message")
            got += count
        return buf

    def readable(self) -> bool:
        """Whether bytes (or the end of the stream) are waiting to be read now."""
        return bool(self._poller.poll(0))

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.shared is not None:
            self.shared.close()


def write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` (any buffer) to ``fd``, however many writes it takes."""
    data = data.cast("B")
    while data:
        data = data[os.write(fd, data):]


#: Payloads from this size on go through shared memory where a :class:`Pipe` has it (smaller ones: the pipe).
SHARED_MIN = 1 << 20


class SharedMemory:
    """Large payloads through shared memory, beside a :class:`Pipe` (mhaspec's runner and Python worker only).

    The sender writes the payload into a fresh anonymous memory file (``memfd_create``)
    and sends its descriptor, with the payload's length, over ``channel`` (one end of a
    Unix datagram socket pair) *before* the frame, whose payload it then leaves out of
    the pipe; the receiver, having read a frame whose payload is not on the pipe, finds
    the descriptor already queued and maps the file read-only: the arrays are views of
    the pages the sender wrote, copied once instead of twice (through the pipe and into
    a 4 KiB-paged buffer).  The file has no name: it lives as long as a descriptor or a
    mapping holds it, so a crash, a timeout or a kill of either side leaves nothing
    behind (a descriptor still queued is freed with the socket).  Where the platform
    has no ``memfd_create`` or it fails, the sender uses the pipe, silently, from then on.
    """

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.usable = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

    @staticmethod
    def pair() -> tuple[SharedMemory, socket.socket] | None:
        """(this side's SharedMemory, the other side's socket to give its process), or None where the
        platform has no Unix sockets, ``memfd_create`` or descriptor passing."""
        if not (hasattr(socket, "AF_UNIX") and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")):
            return None
        try:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:
            return None
        return SharedMemory(mine), theirs

    def carries(self, buffers: list[memoryview]) -> bool:
        """Send ``buffers`` (a payload of :data:`SHARED_MIN` bytes or more) ahead of their frame; False: the
        pipe must carry them (a small payload, or no shared memory here).  OSError: the other side is gone."""
        nbytes = sum(b.nbytes for b in buffers)
        if not self.usable or nbytes < SHARED_MIN:
            return False
        fd = memory_file(buffers)
        if fd is None:
            self.usable = False
            return False
        try:
            socket.send_fds(self.channel, [nbytes.to_bytes(8, "little")], [fd])
        finally:
            os.close(fd)
        return True

    def receive(self, n_payload: int) -> mmap.mmap | bytearray | None:
        """The payload of the frame just read if it came through shared memory (read-only), else None.
        :class:`Malformed` if what came is not ``n_payload`` bytes."""
        fds = array.array("i")
        try:  # not socket.recv_fds: before Python 3.12 it ignores its flags (and would block here)
            data, ancillary, _, _ = self.channel.recvmsg(8, socket.CMSG_LEN(fds.itemsize), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise Closed(str(exc)) from None
        for level, kind, item in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(item[:len(item) - len(item) % fds.itemsize])
        if not fds:
            raise Malformed("a shared-memory notice without its memory file")
        try:
            nbytes = int.from_bytes(data, "little")
            if len(data) != 8 or nbytes != n_payload or os.fstat(fds[0]).st_size != n_payload:
                raise Malformed(f"a {n_payload}-byte payload whose shared memory holds another size")
            return map_read_only(fds[0], n_payload)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self.channel.close()


def memory_file(buffers: list[memoryview]) -> int | None:
    """A new anonymous memory file holding ``buffers`` one after the other (its descriptor; read it by offset),
    or None where ``memfd_create`` fails.  Written with ``write``: page cache, not the writer's memory."""
    try:
        fd = os.memfd_create("mhaspec-payload", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        for data in buffers:
            write_all(fd, data)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_read_only(fd: int, nbytes: int) -> mmap.mmap | bytearray:
    """The ``nbytes`` of file ``fd``: a read-only shared mapping, its pages mapped at once (one call instead
    of a page fault per 4 KiB); read into memory of its own where it cannot be mapped."""
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    except (OSError, ValueError):
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            count = os.preadv(fd, [view[got:]], got)
            if not count:
                raise Malformed("a shared payload shorter than its frame says") from None
            got += count
        return buf


def encode_frame(header: Mapping[str, Any], payload: bytes | safetensors.Parts = b"") -> bytes:
    """The bytes of one message."""
    text = json.dumps(header).encode("utf-8")
    return FRAME.pack(len(text), len(payload)) + text + bytes(payload)


def decode_frame(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    """(header, payload) of the bytes of one message (:func:`encode_frame`); :class:`Malformed` otherwise."""
    view = memoryview(data).cast("B")
    if view.nbytes < FRAME.size:
        raise Malformed(f"a message of {view.nbytes} bytes, shorter than its {FRAME.size}-byte frame")
    n_header, n_payload = FRAME.unpack(view[:FRAME.size])
    check_lengths(n_header, n_payload)
    if view.nbytes != FRAME.size + n_header + n_payload:
        raise Malformed(f"a message of {view.nbytes} bytes whose frame says {FRAME.size + n_header + n_payload}")
    return decode_header(bytes(view[FRAME.size:FRAME.size + n_header])), view[FRAME.size + n_header:]


def check_lengths(n_header: int, n_payload: int) -> None:
    if n_header > MAX_HEADER or n_payload > MAX_PAYLOAD:
        raise Malformed(f"a message of {n_header} + {n_payload} bytes")


def decode_header(text: bytes | bytearray) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Malformed(f"a header that is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise Malformed("a header that is not a JSON object")
    return header


# -- the handshake ---------------------------------------------------------------------


def check_protocol(header: Mapping[str, Any], sender: str = "the worker") -> None:
    """:class:`ProtocolError` unless ``header`` says ``"protocol": "mhaspec-wire/1"``."""
    got = header.get("protocol")
    if got != PROTOCOL:
        said = f"speaks {got!r}" if got is not None else "sent no protocol version"
        raise ProtocolError(f"{sender} {said}; this mhaspec speaks {PROTOCOL!r} (docs/protocol.md)")


def load_request(adapter: str, options: Mapping[str, Any], sys_path: list[str]) -> dict[str, Any]:
    """The first message to mhaspec's own spawned Python worker: which adapter to load."""
    return {"op": "load", "protocol": PROTOCOL, "adapter": adapter, "options": dict(options), "sys_path": sys_path}


def ready(info: Mapping[str, Any], environment: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's first message: the adapter's description (contract.describe_adapter) and where it computes."""
    return {"reply": "ready", "protocol": PROTOCOL, "ok": True, **info, "environment": dict(environment)}


def failure(reply: str, error: str) -> dict[str, Any]:
    """A reply saying the step (or loading: ``ready``) failed, with a one-line cause."""
    header: dict[str, Any] = {"reply": reply, "ok": False, "error": error}
    if reply == "ready":
        header["protocol"] = PROTOCOL
    return header


#: What ``ready`` may leave out, and what it then means (a Python worker always sends every key).
READY_DEFAULTS: dict[str, Any] = {"deviations": [], "framework": None, "framework_version": None,
                                  "has_supports": False, "has_backward": False, "has_decode": False, "packed": False,
                                  "variants": []}


def check_ready(header: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter's description in a successful ``ready`` (defaults filled in); :class:`Malformed`
    naming the first key that is missing or of the wrong type."""
    info = {**READY_DEFAULTS, **{k: v for k, v in header.items() if k not in ("ok", "reply", "protocol")}}
    if not isinstance(info.get("name"), str) or not info["name"]:
        raise Malformed("a 'ready' without a name (a non-empty string)")
    dtypes = info.get("dtypes")
    if not isinstance(dtypes, list) or not dtypes or not all(isinstance(d, str) for d in dtypes):
        raise Malformed(f"a 'ready' whose dtypes is not a non-empty list of dtype names ({dtypes!r})")
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise Malformed(f"a 'ready' whose dtypes {unknown} are not among {', '.join(DTYPES)}")
    info["dtypes"] = [d for d in DTYPES if d in dtypes]
    variants = info["variants"]
    if not isinstance(variants, list) or not all(isinstance(v, str) for v in variants):
        raise Malformed(f"a 'ready' whose variants is not a list of variant names ({variants!r})")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise Malformed(f"a 'ready' whose variants {unknown} are not among {', '.join(VARIANTS)}")
    for key in ("has_supports", "has_backward", "has_decode", "packed"):
        if not isinstance(info[key], bool):
            raise Malformed(f"a 'ready' whose {key} is not true or false ({info[key]!r})")
    for key in ("framework", "framework_version"):
        if info[key] is not None and not isinstance(info[key], str):
            raise Malformed(f"a 'ready' whose {key} is not a string or null ({info[key]!r})")
    if not isinstance(info["deviations"], list):
        raise Malformed(f"a 'ready' whose deviations is not a list ({type(info['deviations']).__name__})")
    return info


def check_unsupported(rules: Any) -> list[dict[str, str]]:
    """A program's ``unsupported`` rules from ``ready``: ``[{"case": PATTERN, "dtype": PATTERN, "reason":
    TEXT}]`` (patterns as in deviations, default ``*``); :class:`Malformed` naming a bad rule."""
    if not isinstance(rules, list):
        raise Malformed(f"a 'ready' whose unsupported is not a list ({type(rules).__name__})")
    out = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping) or set(rule) - {"case", "dtype", "reason"}:
            raise Malformed(f"a 'ready' whose unsupported[{i}] is not an object of case, dtype, reason ({rule!r})")
        entry = {"case": rule.get("case", "*"), "dtype": rule.get("dtype", "*"), "reason": rule.get("reason")}
        if not all(isinstance(v, str) and v for v in entry.values()):
            raise Malformed(f"a 'ready' whose unsupported[{i}] needs non-empty strings case, dtype and reason "
                            f"({rule!r})")
        out.append(entry)
    return out


def check_reply(header: Mapping[str, Any], expected: str, seq: int | None = None) -> None:
    """:class:`Malformed` unless ``header`` is a reply to ``expected`` (a step, or ``ready``) — and, when it
    echoes a request number (``seq``), to request ``seq``."""
    kind = header.get("reply")
    if kind != expected:
        raise Malformed(f"a reply of kind {kind!r} where {expected!r} was due")
    got = header.get("seq")
    if seq is not None and got is not None and got != seq:
        raise Malformed(f"a reply to request {got!r} where request {seq}'s was due (did it answer a request twice?)")
    if not isinstance(header.get("ok"), bool) or (header["ok"] is False and not isinstance(header.get("error"), str)):
        raise Malformed(f"a {expected!r} reply without ok (true, or false with an error)")
    if expected == "supports" and header["ok"] and not isinstance(header.get("answer"), (bool, str)):
        raise Malformed("a 'supports' reply without an answer (true, false or a reason)")


# -- a case, runner -> worker ----------------------------------------------------------


def case_request(op: str, case: Case, seq: int | None = None) -> tuple[dict[str, Any], safetensors.Parts]:
    """A request carrying ``case``: its scalar fields, its config and which inputs are one array, and bytes.

    Generic over the Case's fields, so a field added to the spec travels too;
    an input that is the same array as another (self-attention, key = value)
    travels once and is the same array again on the other side.
    """
    header, payload = case_message(case)
    return {"op": op, **({} if seq is None else {"seq": seq}), "case": header}, payload


def reuse_request(op: str, seq: int | None = None) -> dict[str, Any]:
    """A request for the case the worker already holds (the one of the previous request)."""
    return {"op": op, **({} if seq is None else {"seq": seq}), "reuse": True}


def close_request() -> dict[str, Any]:
    return {"op": "close"}


def case_message(case: Case) -> tuple[dict[str, Any], safetensors.Parts]:
    """(the ``case`` object of a request, the payload) for ``case``."""
    scalars = {name: getattr(case, name) for name in type(case).model_fields
               if name not in ("config", "inputs", "weights", "d_output")}
    # mhaspec-wire/1 has no schedule, seq_lens or paging (docs/serving.md): a case without them is unchanged, and
    # an exec client is never sent a case with one
    for name in ("schedule", "seq_lens", "page_size", "block_table", "num_pages"):
        if scalars[name] is None:
            del scalars[name]
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
    return header, safetensors.encode_parts(arrays)


def case_from_message(header: Mapping[str, Any], payload: bytes) -> Case:
    """The Case of :func:`case_message` (its arrays read-only views of ``payload``)."""
    arrays = safetensors.decode(payload)
    inputs = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("input.")}
    for name, same_as in header["aliases"].items():
        inputs[name] = inputs[same_as]
    weights = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("weight.")}
    return Case(config=MHAConfig.model_validate(header["config"]), inputs=Inputs(**inputs), weights=Weights(**weights),
                d_output=arrays.get("grad.d_output"), **header["scalars"])


# -- what the adapter returned, worker -> runner ---------------------------------------


def supports_reply(answer: Any) -> dict[str, Any]:
    return {"reply": "supports", "ok": True, "answer": answer if isinstance(answer, (bool, str)) else False}


def returned_reply(step: str, returned: Any, seconds: float) -> tuple[dict[str, Any], safetensors.Parts | bytes]:
    """What ``run()`` or ``backward()`` returned, as a header (keys, stages that cannot travel as arrays) and bytes."""
    if not isinstance(returned, Mapping):
        return {"reply": step, "ok": True, "seconds": seconds, "mapping": False, "type": type(returned).__name__}, b""
    described, arrays = _described_mapping(returned)
    return {"reply": step, "ok": True, "seconds": seconds, **described}, safetensors.encode_parts(arrays)


def decoded_reply(returned: Any, seconds: float) -> tuple[dict[str, Any], safetensors.Parts | bytes]:
    """What ``decode()`` returned (a list of one mapping per call, docs/serving.md) as a header — each
    call's keys and stages that cannot travel as arrays, under ``calls`` — and bytes: call c's stage
    ``NAME`` is the array ``c/NAME``.  Anything but a list or tuple travels as its type's name."""
    if not isinstance(returned, (list, tuple)):
        return {"reply": "decode", "ok": True, "seconds": seconds, "sequence": False,
                "type": type(returned).__name__}, b""
    calls: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for c, mapping in enumerate(returned):
        if not isinstance(mapping, Mapping):
            calls.append({"mapping": False, "type": type(mapping).__name__})
            continue
        described, own = _described_mapping(mapping)
        calls.append(described)
        arrays.update({f"{c}/{name}": array for name, array in own.items()})
    header = {"reply": "decode", "ok": True, "seconds": seconds, "sequence": True, "calls": calls}
    return header, safetensors.encode_parts(arrays)


def _described_mapping(returned: Mapping[Any, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """({mapping, keys, special}, the arrays by stage name) of a returned mapping of stage name to array."""
    arrays: dict[str, np.ndarray] = {}
    special: dict[str, Any] = {}
    for key, value in returned.items():
        if not (isinstance(key, str) and key in REGISTRY):  # every stage: spec 1.1's, the variants', backward
            continue  # the runner only needs the name to report it
        try:
            array = np.asarray(value)
        except Exception as exc:  # e.g. a tensor that requires grad
            special[key] = {"type": type(value).__name__, "error": str(exc)}
            continue
        if array.dtype.name in safetensors.CODES:
            arrays[key] = array
        else:  # complex, object, str ...: judged by dtype alone, so the dtype and shape suffice
            special[key] = {"dtype": array.dtype.str, "name": array.dtype.name, "shape": list(array.shape)}
    return {"mapping": True, "keys": [str(k) for k in returned], "special": special}, arrays


class _Unconvertible:
    """Stands for a returned value numpy could not convert in the worker."""

    def __init__(self, error: str) -> None:
        self._error = error

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(self._error)


def unpack_returned(header: Mapping[str, Any], payload: bytes) -> Any:
    """What the adapter returned, as the runner judges it: a mapping of the returned keys (arrays,
    stand-ins of the values that could not travel, None for a key that is not a stage), or a
    stand-in object of the returned type's name when it was not a mapping."""
    return _unpack_mapping(header, safetensors.decode(payload))


def unpack_decoded(header: Mapping[str, Any], payload: bytes) -> Any:
    """What ``decode()`` returned (:func:`decoded_reply`), as the runner judges it: a list of each call's
    mapping (as :func:`unpack_returned` gives it), or a stand-in object of the returned type's name."""
    if not header["sequence"]:
        return type(header["type"], (), {})()
    arrays = safetensors.decode(payload)
    out = []
    for c, described in enumerate(header["calls"]):
        prefix = f"{c}/"
        own = {name[len(prefix):]: a for name, a in arrays.items() if name.startswith(prefix)}
        out.append(_unpack_mapping(described, own))
    return out


def _unpack_mapping(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> Any:
    if not header["mapping"]:
        return type(header["type"], (), {})()  # an object of the same type name: judged as "not a mapping"
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
                    name = info["name"]
                    dtype = safetensors.numpy_dtype(name) if name.startswith(("bfloat", "float8")) else np.dtype(info["dtype"])
                except (TypeError, AttributeError, ImportError):
                    dtype = np.dtype(object)
                out[key] = np.zeros(info["shape"], dtype=dtype) if dtype != np.dtype(object) else np.empty(info["shape"], object)
        else:
            out[key] = None  # not a stage: reported by name
    return out
