"""Adapters: one small module per backend, each of the same shape
(convert weights, convert mask polarity, call the layer, convert back).

An adapter is any object with ``name`` and ``run(case) -> Mapping[str, ArrayLike]``
(docs/spec.md §5).  Optional: ``supports(case) -> bool | str``,
``known_deviations`` (see :class:`Deviation`), ``dtypes`` (the dtypes it can
compute in), ``framework`` (the distribution whose version the report shows).

Adapters import ``mhaspec.spec`` (and their framework, lazily, inside the
module that needs it) — never ``mhaspec.reference`` or ``mhaspec.conformance``.
"""

from .base import (
    BUILTINS,
    Adapter,
    BuiltinAdapter,
    Deviation,
    adapter_dtypes,
    adapter_framework,
    adapter_name,
    builtin_status,
    load_adapter,
    parse_deviations,
)

__all__ = [
    "BUILTINS",
    "Adapter",
    "BuiltinAdapter",
    "Deviation",
    "adapter_dtypes",
    "adapter_framework",
    "adapter_name",
    "builtin_status",
    "load_adapter",
    "parse_deviations",
]
