"""How the runner reaches an adapter: one interface (:class:`Transport`), several carriers.

- :class:`InProcess` — the adapter object called in the runner's process (``isolate=False``).
- :class:`Worker` — a Python adapter in a worker process speaking ``mhaspec-wire/1``,
  forked or spawned (:func:`start_method`); a crash or a hang costs one case.
- :class:`Program` — an adapter program in any language, ``exec:PROGRAM ARGS…``
  (docs/protocol.md), speaking the same protocol.
- :class:`ProcessTransport` — the runner's side of the wire to any worker process; a group
  of ranks is a new subclass that starts its processes differently.
"""

from __future__ import annotations

from .base import AdapterCrash, CaseTimeout, Transport, validate_timeout
from .inprocess import InProcess
from .process import FRAMEWORKS, LOAD_TIMEOUT, Process, ProcessTransport, Worker, death_cause, start_method
from .program import Program, is_program


def for_name(adapter: str, options: dict | None = None) -> ProcessTransport:
    """The transport for an adapter given by name: a :class:`Program` for ``exec:PROGRAM ARGS…``, else a
    :class:`Worker` that loads the Python adapter (``options``: its constructor's keyword arguments)."""
    if is_program(adapter):
        given = {k: v for k, v in (options or {}).items() if v is not None}
        if given:
            from ...errors import MhaspecError

            raise MhaspecError(f"adapter {adapter!r}: a program takes no adapter options ({', '.join(given)}); "
                               "pass them as its arguments")
        return Program(adapter)
    return Worker(adapter, options)

__all__ = [
    "FRAMEWORKS",
    "LOAD_TIMEOUT",
    "AdapterCrash",
    "CaseTimeout",
    "InProcess",
    "Process",
    "ProcessTransport",
    "Program",
    "Transport",
    "Worker",
    "death_cause",
    "for_name",
    "is_program",
    "start_method",
    "validate_timeout",
]
