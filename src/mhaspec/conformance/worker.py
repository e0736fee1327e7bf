"""Moved: the worker and its wire format now live in :mod:`mhaspec.protocol`.

- the wire format (``mhaspec-wire/1``, docs/protocol.md): :mod:`mhaspec.protocol.wire`;
- the arrays as safetensors bytes: :mod:`mhaspec.io.safetensors`;
- the Python worker process: :mod:`mhaspec.protocol.worker`;
- the runner's side (:class:`Worker`, :class:`InProcess`): :mod:`mhaspec.protocol.transports`.

These names are re-exported here for code written against the old module.
"""

from __future__ import annotations

from ..io.safetensors import decode as decode_arrays  # noqa: F401 (re-exported)
from ..io.safetensors import encode as encode_arrays  # noqa: F401
from ..protocol.contract import describe_adapter  # noqa: F401
from ..protocol.transports import (  # noqa: F401
    FRAMEWORKS,
    LOAD_TIMEOUT,
    AdapterCrash,
    CaseTimeout,
    InProcess,
    Worker,
    start_method,
    validate_timeout,
)
from ..protocol.wire import MAX_HEADER, MAX_PAYLOAD  # noqa: F401
from ..protocol.wire import case_from_message as _case_from_message  # noqa: F401
from ..protocol.wire import case_message as _case_message  # noqa: F401
from ..protocol.worker import describe_exception as _describe  # noqa: F401
from ..protocol.worker import main, serve  # noqa: F401
