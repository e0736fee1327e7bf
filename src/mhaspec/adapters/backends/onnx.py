"""ONNX as a backend: element types, initializers, the mask the graphs take, and the
onnxruntime session they run in.

ONNX tensors are NumPy arrays in the canonical layout (arrays in: :func:`array_in`, the NumPy
backend's); the ONNX ``MatMul`` computes ``x @ W``, so a canonical weight (``(in, out)``,
``y = x @ W + b``) is an initializer as it is.  bfloat16 travels as ``ml_dtypes.bfloat16``
(``onnx.numpy_helper`` reads and writes it as ``TensorProto.BFLOAT16``).

onnx is imported here; onnxruntime only inside :func:`ort_session`, so the
``onnx-reference`` adapter needs onnx alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ...spec import Case, Weights, masks
from .numpy import array_in
from .numpy import weights_in as canonical

__all__ = [
    "ELEM_TYPES", "ORT_NO_BFLOAT16", "array_in", "dtype", "graph_structure", "input_feed", "keep_mask", "ort_session",
    "replace_initializers", "weights_in", "weights_out",
]

#: spec dtype name -> ONNX element type
ELEM_TYPES: dict[str, int] = {
    "float64": TensorProto.DOUBLE,
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
}

#: Why onnxruntime's CPU execution provider cannot run a bfloat16 graph
#: (checked by tests/frameworks/test_onnx.py: the day a kernel appears, the test fails).
ORT_NO_BFLOAT16 = (
    "onnxruntime's CPU execution provider has no bfloat16 kernel for MatMul (NOT_IMPLEMENTED: "
    "'Could not find an implementation for MatMul(13)')"
)


def dtype(name: str) -> int:
    """The ONNX element type (``TensorProto.DOUBLE`` …) for a spec dtype name."""
    try:
        return ELEM_TYPES[name]
    except KeyError:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(ELEM_TYPES)}") from None


def keep_mask(case: Case, *, causal: bool = False) -> np.ndarray | None:
    """The case's explicit mask as ``(B|1, 1, T, S)`` bool, True = may attend (its query axis
    spelled out), ANDed with the causal band when ``causal``; None when nothing is masked."""
    T, S = case.tgt_len, case.src_len
    mask = case.inputs.mask
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = np.ascontiguousarray(np.broadcast_to(mask, mask.shape[:2] + (T, S)), dtype=bool)
    band = masks.causal_visible(case.config, T, S) if causal else None
    if band is None:
        return mask
    return band[None, None] if mask is None else mask & band[None, None]


def input_feed(case: Case, **extra: np.ndarray | None) -> dict[str, np.ndarray]:
    """A graph's inputs for ``case``: ``query``, ``key``, ``value`` in the case's dtype (one array
    where the case has one tensor), and each of ``extra`` that is not None (a mask)."""
    query, key, value = case.inputs_as(lambda x: array_in(x, case.dtype))
    feed = {"query": query, "key": key, "value": value}
    feed.update({name: a for name, a in extra.items() if a is not None})
    return feed


def weights_in(weights: Weights | Mapping[str, Any], dtype: str) -> list[TensorProto]:
    """Weights (canonical, or any ``{name: float64 array}``) -> initializers of the spec dtype
    ``dtype``, same names, same layout (absent biases left out)."""
    return [numpy_helper.from_array(array_in(a, dtype), name) for name, a in canonical(weights).items()]


def weights_out(graph: onnx.GraphProto, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """A graph's initializers (all, or those in ``names``) as float64 numpy arrays (exact)."""
    wanted = None if names is None else set(names)
    return {
        t.name: numpy_helper.to_array(t).astype(np.float64)
        for t in graph.initializer
        if wanted is None or t.name in wanted
    }


def replace_initializers(model: onnx.ModelProto, tensors: Iterable[TensorProto]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers of the same names are ``tensors``.

    Every replacement must exist with the same shape and element type: the
    graph was built (or exported) for exactly these weights' layout.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {t.name: i for i, t in enumerate(out.graph.initializer)}
    for tensor in tensors:
        i = by_name.get(tensor.name)
        if i is None:
            raise ValueError(f"initializer {tensor.name!r}: not in the graph (it has {', '.join(by_name)})")
        old = out.graph.initializer[i]
        if list(old.dims) != list(tensor.dims) or old.data_type != tensor.data_type:
            raise ValueError(
                f"initializer {tensor.name!r}: graph has shape {list(old.dims)} type {old.data_type}, "
                f"got shape {list(tensor.dims)} type {tensor.data_type}"
            )
        out.graph.initializer[i].CopyFrom(tensor)
    return out


def graph_structure(model: onnx.ModelProto) -> tuple[tuple[str, ...], list[str]]:
    """What a graph computes, free of value and node names and of node order.

    Each value is described by what produces it — a graph input or initializer by its
    name, type and shape; a node output by the node's domain, op type, attributes
    (constant tensors by their bytes) and the descriptions of its inputs — so two graphs
    have the same structure when they apply the same operators to the same inputs in the
    same way.  Returns (the descriptions of the graph's outputs, by output name; the sorted
    descriptions of all nodes).  Two equal structures compute the same results.
    """
    import hashlib

    graph = model.graph
    described: dict[str, str] = {"": ""}
    for value in graph.input:
        described[value.name] = f"input {value.name} {value.type.SerializeToString().hex()}"
    for tensor in graph.initializer:
        described[tensor.name] = f"initializer {tensor.name} {tensor.data_type} {list(tensor.dims)}"

    def attribute(attr: onnx.AttributeProto) -> str:
        if attr.type == onnx.AttributeProto.TENSOR:
            array = numpy_helper.to_array(attr.t)
            return f"{attr.name}=tensor({attr.t.data_type},{list(attr.t.dims)},{array.tobytes().hex()})"
        if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise ValueError(f"graph_structure: node attribute {attr.name!r} holds a subgraph (not supported)")
        copy = onnx.AttributeProto()
        copy.CopyFrom(attr)
        copy.ClearField("doc_string")
        return copy.SerializeToString(deterministic=True).hex()

    nodes = []
    for node in graph.node:  # topological order (checked: every input is described first)
        missing = [name for name in node.input if name not in described]
        if missing:
            raise ValueError(f"graph_structure: node {node.name!r} reads {missing} before they are produced")
        head = "|".join([node.domain, node.op_type, *sorted(attribute(a) for a in node.attribute)])
        body = hashlib.sha256("|".join([head, *(described[name] for name in node.input)]).encode()).hexdigest()
        nodes.append(body)
        for k, name in enumerate(node.output):
            described[name] = f"{body}:{k}"
    return tuple(described[o.name] for o in graph.output), sorted(nodes)


def ort_session(model: onnx.ModelProto, threads: int = 1) -> Any:
    """An onnxruntime ``InferenceSession`` on the CPU execution provider, default graph optimizations."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 4  # fatal only: errors come back as exceptions
    return ort.InferenceSession(model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])
