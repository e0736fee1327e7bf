"""The adapter contract and loading by name, re-exported from their home, :mod:`mhaspec.protocol`.

Kept so that existing adapters and users' code (``from mhaspec.adapters.base import Deviation``)
keep working; new code imports :mod:`mhaspec.protocol.contract` (an adapter) or
:mod:`mhaspec.protocol.loading` (finding one by name).
"""

from __future__ import annotations

from ..protocol.contract import (  # noqa: F401 (re-exported)
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
from ..protocol.loading import (  # noqa: F401 (re-exported)
    BUILTINS,
    EXTRA_OF_MODULE,
    TORCH_CPU_INDEX,
    BuiltinAdapter,
    _import_target,
    builtin_status,
    install_command,
    load_adapter,
    missing_hint,
)
