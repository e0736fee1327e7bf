"""The one safetensors codec: bytes <-> a dict of numpy arrays.

Used for the golden fixtures on disk (mhaspec.fixtures) and for the arrays on the
wire between the runner and a worker (mhaspec.protocol.wire).  The format
(https://github.com/huggingface/safetensors)::

    <u64 little-endian N> <N bytes: a JSON object, padded with spaces to a multiple of 8> <data>

The JSON object maps each tensor's name to ``{"dtype": CODE, "shape": [...],
"data_offsets": [start, end]}`` (offsets into ``data``), and optionally
``"__metadata__"`` to a string -> string object.  Tensor data is C-ordered and
little-endian; bfloat16 and float16 are their raw 16 bits, bool one byte (0 or 1).

:func:`encode` is canonical: tensors in name order, every key sorted, compact
JSON — the same arrays give the same bytes (the golden files are
byte-identical from one generate to the next).  bfloat16 and float8 need
``ml_dtypes``, imported only when such an array is decoded.  Nothing is pickled.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

#: numpy dtype name -> safetensors dtype code
CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "bool": "BOOL",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
#: safetensors dtype code -> numpy dtype name
NAMES: dict[str, str] = {code: name for name, code in CODES.items()}

#: Bytes of the header-length prefix.
PREFIX = 8

_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


class SafetensorsError(ValueError):
    """Bytes that are not a safetensors file this codec reads; the message says what is wrong."""


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name of :data:`CODES` (bfloat16 and float8 from ml_dtypes)."""
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


class Parts:
    """Safetensors bytes as the buffers that make them up, never joined: the prefix and header, then
    each tensor's own memory (no copy where the array is already C-ordered little-endian).
    ``len()`` is the number of bytes, ``bytes()`` joins them; a writer writes :attr:`buffers` in order."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.nbytes = sum(b.nbytes for b in buffers)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.buffers)


def encode_parts(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> Parts:
    """:func:`encode` without the copy: the same bytes as :class:`Parts` (streamed by the wire protocol)."""
    header: dict[str, Any] = {} if metadata is None else {"__metadata__": dict(metadata)}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if array.dtype.name not in CODES:
            raise TypeError(f"tensor {name}: dtype {array.dtype} has no safetensors code")
        order = array.dtype.byteorder
        if order == ">" or (order == "=" and sys.byteorder == "big"):
            array = array.astype(array.dtype.newbyteorder("<"))
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # its bytes, not a copy
        header[name] = {"dtype": CODES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        chunks.append(data)
        offset += data.nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    return Parts([memoryview(len(text).to_bytes(PREFIX, "little") + text), *chunks])


def encode(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes of ``tensors`` (any dtype of :data:`CODES`), little-endian, canonical."""
    return bytes(encode_parts(tensors, metadata))


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """N, the JSON header's length, from the first 8 bytes."""
    if len(prefix) < PREFIX:
        raise SafetensorsError(f"shorter than {PREFIX} bytes")
    return int.from_bytes(bytes(prefix[:PREFIX]), "little")


def parse_header(text: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The JSON header (the N bytes after the prefix) as a dict."""
    try:
        header = json.loads(bytes(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    return header


def decode(data: bytes | bytearray | memoryview | Parts, copy: bool = False) -> dict[str, np.ndarray]:
    """The tensors of safetensors ``data``, in the header's order (``__metadata__`` is left out).

    ``copy=False``: read-only views of ``data`` (no copy; an array may be unaligned);
    ``copy=True``: aligned, writeable arrays of their own.  Every entry is checked
    (dtype code, shape, offsets within the data and matching the shape) before any
    array is made; empty ``data`` is no tensors.
    """
    if not len(data):
        return {}
    if isinstance(data, Parts):
        data = bytes(data)
    view = memoryview(data).cast("B")
    n = header_length(view)
    if PREFIX + n > len(view):
        raise SafetensorsError(f"header length {n} bytes is beyond the {len(view)}-byte buffer")
    header = parse_header(view[PREFIX : PREFIX + n])
    base, size = PREFIX + n, len(view) - PREFIX - n
    checked = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        checked.append((name, *_entry(name, info, size)))
    out = {}
    for name, dtype, shape, start, count in checked:
        if count == 0:
            array = np.empty(shape, dtype)
        else:
            array = np.frombuffer(view, dtype=dtype, count=count, offset=base + start).reshape(shape)
        if copy:
            array = array.copy()
        elif array.flags.writeable:
            array.flags.writeable = False
        out[name] = array
    return out


def _entry(name: str, info: Any, size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, start, element count) of one header entry, checked against ``size`` bytes of data."""
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name}: header entry is not an object")
    code = info.get("dtype")
    if code not in NAMES:
        raise SafetensorsError(f"tensor {name}: unknown dtype {code!r} (known: {', '.join(NAMES)})")
    shape = info.get("shape")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise SafetensorsError(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
    offsets = info.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise SafetensorsError(f"tensor {name}: data_offsets {offsets!r} is not [start, end]")
    start, end = offsets
    dtype = numpy_dtype(NAMES[code])
    count = math.prod(shape)
    if not 0 <= start <= end <= size or end - start != count * dtype.itemsize:
        raise SafetensorsError(f"tensor {name}: data_offsets {offsets} do not hold a {code} tensor of shape "
                               f"{tuple(shape)} within {size} bytes of data")
    return dtype, tuple(shape), start, count
