"""How the runner reaches an adapter: one interface (:class:`Transport`), several carriers.

- :class:`InProcess` — the adapter object called in the runner's process (``isolate=False``).
- :class:`Worker` — a Python adapter in a worker process speaking ``mhaspec-wire/1``,
  forked or spawned (:func:`start_method`); a crash or a hang costs one case.
- :class:`ProcessTransport` — the runner's side of the wire to any worker process; an
  executable adapter (``exec:PROGRAM``, docs/protocol.md) or a group of ranks is a new
  subclass that starts its processes differently.
"""

from __future__ import annotations

from .base import AdapterCrash, CaseTimeout, Transport, validate_timeout
from .inprocess import InProcess
from .process import FRAMEWORKS, LOAD_TIMEOUT, Process, ProcessTransport, Worker, death_cause, start_method

__all__ = [
    "FRAMEWORKS",
    "LOAD_TIMEOUT",
    "AdapterCrash",
    "CaseTimeout",
    "InProcess",
    "Process",
    "ProcessTransport",
    "Transport",
    "Worker",
    "death_cause",
    "start_method",
    "validate_timeout",
]
