"""An adapter that is a program, in any language: ``exec:PROGRAM ARGS…`` speaking ``mhaspec-wire/1``.

The runner starts ``PROGRAM ARGS…`` (split as a shell would, no shell run) in
its current directory, with stdin from ``/dev/null``, and hands it two pipes
whose descriptor numbers it finds in the environment variable
``MHASPEC_WIRE_FDS`` (``READ_FD,WRITE_FD``).  The program speaks first
(``ready``: its name, dtypes, ``supports`` rules and known deviations); there
is no ``load``.  Its stdout and stderr both go to the runner's stderr, so that
what it prints reaches the user and never mixes with the report.

Everything after the start is :class:`~.process.ProcessTransport`: a crash, a
hang, bytes that are not frames, a partial write, another protocol version or
a reply nobody asked for cost one case, and the next case gets a fresh process
(docs/protocol.md §6).  A program is always its own process: ``isolate=False``
does not apply to it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...errors import AdapterError, MhaspecError
from ...spec import Case
from .. import contract, wire
from .base import AdapterCrash
from .process import LOAD_TIMEOUT, Process, ProcessTransport

#: The prefix that names an adapter program.
PREFIX = "exec:"

#: The environment variable carrying the two descriptors' numbers, ``READ_FD,WRITE_FD``.
FDS_ENV = "MHASPEC_WIRE_FDS"


def is_program(adapter: Any) -> bool:
    """Whether ``adapter`` names a program (``exec:…``)."""
    return isinstance(adapter, str) and adapter.startswith(PREFIX)


def command(adapter: str) -> list[str]:
    """The argument vector of ``exec:PROGRAM ARGS…``; a usage error (exit 2) naming what is wrong."""
    text = adapter[len(PREFIX):]
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise MhaspecError(f"adapter {adapter!r}: cannot split the command line ({exc})") from None
    if not argv:
        raise MhaspecError(f"adapter {adapter!r}: no program after 'exec:' (exec:PROGRAM ARGS…)")
    program = argv[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        path = Path(program)
        if not path.is_file():
            raise MhaspecError(f"adapter {adapter!r}: no program {program!r} (from {os.getcwd()})")
        if not os.access(path, os.X_OK):
            raise MhaspecError(f"adapter {adapter!r}: {program!r} is not executable (chmod +x, or name its "
                               "interpreter: exec:node mha.js)")
    elif shutil.which(program) is None:
        raise MhaspecError(f"adapter {adapter!r}: no program {program!r} on PATH")
    return argv


class Program(ProcessTransport):
    """An adapter program speaking ``mhaspec-wire/1`` over two pipes (docs/protocol.md §1).

    ``unsupported`` rules from its ``ready`` (``case``/``dtype`` patterns with a
    ``reason``) are answered here, without a round trip; a program whose
    ``ready`` says ``has_supports`` is asked for the rest.
    """

    #: A case with a schedule is never sent to a program (docs/serving.md).
    decode_refusal = "decode is not in mhaspec-wire/1 yet: an exec: adapter is not judged on a case with a schedule (docs/serving.md)"
    #: Nor a packed case: seq_lens is not in mhaspec-wire/1.
    packed_refusal = "seq_lens is not in mhaspec-wire/1 yet: an exec: adapter is not judged on a packed case (docs/serving.md)"

    def __init__(self, adapter: str, load_timeout: float = LOAD_TIMEOUT) -> None:
        self.argv = command(adapter)
        super().__init__(repr(adapter), load_timeout)
        self.adapter = adapter
        self._rules: list[dict[str, str]] = []
        self._asks = False  # the program answers supports itself

    def _launch(self) -> tuple[Process, wire.Pipe]:
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        env = dict(os.environ, **{FDS_ENV: f"{to_child_r},{to_parent_w}"})
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            popen = subprocess.Popen(self.argv, pass_fds=(to_child_r, to_parent_w), env=env,
                                     stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), start_new_session=True)
        except OSError as exc:
            for fd in (to_child_r, to_child_w, to_parent_r, to_parent_w):
                os.close(fd)
            raise AdapterError(f"adapter {self.label}: cannot start {self.argv[0]!r} ({exc.strerror or exc})") from None
        os.close(to_child_r)
        os.close(to_parent_w)
        return Process(popen=popen), wire.Pipe(to_parent_r, to_child_w)

    def wait_loaded(self) -> dict[str, Any]:
        first = not self._ready
        info = super().wait_loaded()
        if first:
            try:
                self._rules = wire.check_unsupported(info.pop("unsupported", None) or [])
                info["deviations"] = [dataclasses.asdict(d) for d in contract.parse_deviations(
                    info.get("deviations"), f"adapter {self.label}: ready: deviations")]
            except (wire.Malformed, AdapterError) as exc:
                self._discard()
                raise AdapterError(f"adapter {self.label}: {exc}") from None
            self._asks = bool(info["has_supports"])
            info["has_supports"] = self._asks or bool(self._rules)
        return info

    def _described(self, environment: Any) -> dict[str, Any] | None:
        """This machine as the runner sees it (the program runs here), with the program's own facts
        (free-form: its language, compiler, library versions) under ``program``."""
        from ... import environment as machine

        described = machine.describe(frameworks=(), process="exec")
        # not the runner's numpy: its BLAS and dispatch say nothing of the program's kernels
        described.update(blas=None, cpu_dispatch={}, frameworks={})
        described["threads"].update(blas=None)
        return {**described, "program": dict(environment) if isinstance(environment, dict) else {}}

    def _refused(self, case: Case) -> str | None:
        for rule in self._rules:
            if contract.match_pattern(case.id, rule["case"]) and contract.match_pattern(case.dtype, rule["dtype"]):
                return rule["reason"]
        return None

    def supports(self, case: Case, timeout: float | None) -> bool | str:
        reason = self._refused(case)
        if reason is not None:
            return reason
        if not self._asks:
            return True
        return super().supports(case, timeout)

    def prefetch(self, case: Case, with_supports: bool) -> None:
        # not with a message already waiting: the next request (_request -> _send) reports it for its case
        if self._refused(case) is None and not (self._pipe is not None and not self._expect and self._pipe.readable()):
            super().prefetch(case, with_supports and self._asks)

    def _send(self, case: Case, with_supports: bool, then: str = "run") -> None:
        self._unasked()
        super()._send(case, with_supports and self._asks, then)

    def _unasked(self) -> None:
        """A message waiting on the reply pipe before a request was sent: the program answered twice
        (or wrote on its own); it costs the case about to be sent."""
        pipe, process = self._pipe, self._process
        if pipe is None or process is None or self._expect or not pipe.readable():
            return
        try:
            header, _ = pipe.recv(time.monotonic() + 1.0)
            what = f"a {header.get('reply') or header.get('op')!r} message" if header else "a message"
        except (wire.Deadline, wire.Closed, wire.Malformed) as exc:
            what = f"bytes ({type(exc).__name__})"
        self._discard()
        raise AdapterCrash(f"the program sent {what} nobody asked for (did it answer a request twice?); "
                           "its process was killed")
