"""Between the runner and an adapter: the contract, loading by name, the wire and its transports.

- :mod:`.contract` — what an adapter is (:class:`Adapter`), the deviations it declares
  (:class:`Deviation`), and how it is described to the runner.  Adapters import only this.
- :mod:`.loading` — an adapter from a built-in name, ``module:attr`` or ``file.py:attr``.
- :mod:`.wire` — ``mhaspec-wire/1``, the language-neutral messages between a runner and a
  worker process (docs/protocol.md; JSON Schemas in ``schema/messages.schema.json``).
- :mod:`.worker` — the Python worker's side of the wire.
- :mod:`.transports` — how the runner reaches an adapter: in this process, or in a worker
  process forked or spawned, all behind one interface (:class:`~.transports.Transport`).

Importing this package imports no ML framework, nor the judging code.
"""

from __future__ import annotations

from .contract import (
    DEVIATION_ROWS,
    DEVIATION_WITHIN,
    Adapter,
    Deviation,
    adapter_dtypes,
    adapter_framework,
    adapter_name,
    describe_adapter,
    match_pattern,
    parse_deviations,
)
from .loading import BUILTINS, BuiltinAdapter, builtin_status, load_adapter

__all__ = [
    "BUILTINS",
    "DEVIATION_ROWS",
    "DEVIATION_WITHIN",
    "Adapter",
    "BuiltinAdapter",
    "Deviation",
    "adapter_dtypes",
    "adapter_framework",
    "adapter_name",
    "builtin_status",
    "describe_adapter",
    "load_adapter",
    "match_pattern",
    "parse_deviations",
]
