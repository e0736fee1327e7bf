"""The ``torch`` adapter's module exported to ONNX by ``torch.onnx.export`` and
run by onnxruntime (built-in adapter ``torch-onnx``) — the path a PyTorch user
takes to deploy.

    MultiHeadAttention (mhaspec.adapters.torch_layer, return_stages=True)
        │ torch.onnx.export(..., dynamo=True, opset_version=23, optimize=False)
        ▼                 (torch.export → decompositions → onnxscript's torchlib)
    ONNX graph: MatMul/Add projections, Reshape/Transpose head split, Unsqueeze/Expand
                (GQA), MatMul, Mul (scale), Where (mask), Softmax, Where (zero masked),
                MatMul, Transpose/Reshape, MatMul/Add — no Attention op (the module
                writes the attention out; it never calls scaled_dot_product_attention)
        │ initializers: q_proj.weight … out_proj.bias (nn.Linear layout, (out, in))
        ▼
    onnxruntime InferenceSession (CPU) ──► all eight stages, named as the spec names them

The graph is exported once per structure (config, B, T, S, mask shape) with
zero weights and kept: the float64, float32 and float16 modules side by side in
one ``torch.onnx.export`` (:func:`export_models`; most of an export's time does
not grow with the module), cut into one graph per dtype — each, node for node,
the export of that dtype's module alone (tested) — and the torchlib registry
built once per process: the export machinery is :mod:`mhaspec.adapters.backends.torch_export`.  Each case's weights are
written into its initializers by :func:`canonical_to_initializers` (the
``nn.Linear`` layout: ``q_proj.weight = w_q.T`` …), so a wrong converter fails the run.
``optimize=False`` keeps the initializers under the module's parameter names
(the default optimizer folds the weight transposes into new initializers
named ``val_N``); onnxruntime folds those Transpose nodes itself when it loads
the graph.  tests/frameworks/test_onnx.py checks that the optimized export
computes bit-identical stages.

The mask is the spec's (True = may attend), ``(B|1, 1, T, S)``; the module
ANDs the causal mask in, in the config's alignment.

``torch-onnx-legacy`` (:class:`TorchOnnxLegacyAdapter`) exports the same module
with the TorchScript-based exporter (``dynamo=False``, deprecated since torch
2.9), once per case × dtype with the case's weights; it keeps the float64 scale
a double.  docs/onnx.md describes both graphs and their run times.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch

from ..protocol.contract import Deviation
from ..spec import STAGES, Case, Weights
from .backends import declared
from .backends import onnx as onnx_backend
from .backends import torch as torch_backend
from .backends.onnx import ORT_NO_BFLOAT16, input_feed, keep_mask, ort_session, replace_initializers
from .backends.torch import LINEAR_NAMES
from .backends.torch_export import (
    EXPORT_DTYPES,
    EXPORT_OPSET,
    ExportCache,
    export_model,
    export_model_legacy,
    export_models,
)


def canonical_to_initializers(weights: Weights | Mapping[str, Any], dtype: str = "float64") -> list[onnx.TensorProto]:
    """Canonical weights -> the exported graph's initializers in ``dtype``.

    Names and layout are the module's ``state_dict``: ``q_proj.weight = w_q.T
    (H·D_k, d_model)``, ``k_proj.weight = w_k.T``, ``v_proj.weight = w_v.T``,
    ``out_proj.weight = w_o.T (d_out, H·D_v)``, ``*.bias = b_*``.
    """
    state = torch_backend.weights_in(weights)
    return onnx_backend.weights_in({name: t.numpy() for name, t in state.items()}, dtype)


def initializers_to_canonical(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The exported graph's parameter initializers -> canonical float64 weights."""
    names = [f"{prefix}.{kind}" for prefix in LINEAR_NAMES.values() for kind in ("weight", "bias")]
    found = onnx_backend.weights_out(model.graph, names)
    return torch_backend.weights_out({k: torch.from_numpy(v) for k, v in found.items()})


class TorchOnnxAdapter:
    """The ``torch-onnx`` adapter: the exported ``torch`` module on onnxruntime's CPU provider."""

    name = "torch-onnx"
    framework = "torch"
    #: the exporter's float32 scale in a float64 graph
    known_deviations = declared("torch", "torch-onnx")

    def __init__(self, *, opset: int = EXPORT_OPSET, optimize: bool = False, threads: int = 1,
                 cache: bool = True) -> None:
        """``optimize=True`` exports as ``torch.onnx.export`` does by default (onnxscript's optimizer
        folds the weight transposes), once per case with its weights: slower, the same stages.
        ``cache=False`` exports every structure afresh instead of reading earlier runs'
        exports from the cache folder (:class:`ExportCache`)."""
        import onnxruntime  # noqa: F401  (imported here, not in the first case's time budget)
        import onnxscript  # noqa: F401  (what torch.onnx.export translates with)

        self.opset, self.optimize, self.threads = opset, optimize, threads
        #: exported graphs (zero weights) by structure, then dtype; exports and sessions made so far
        self._exported: dict[tuple, dict[str, onnx.ModelProto]] = {}
        self.exports = self.sessions = 0
        self.cache = ExportCache(enabled=cache and not optimize)

    def supports(self, case: Case) -> bool | str:
        if case.dtype == "bfloat16":
            return ORT_NO_BFLOAT16
        return True

    def model(self, case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The exported graph with the case's weights, and its input feed."""
        mask = keep_mask(case)  # (B|1, 1, T, S); the module ANDs the causal band in
        shape = dict(batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len,
                     mask_shape=None if mask is None else mask.shape, opset=self.opset)
        if self.optimize:  # the optimizer renames the folded weights: export with the case's own
            self.exports += 1
            model = export_model(case.config, case.dtype, weights=case.weights, optimize=True, **shape)
        else:
            key = (case.config.model_dump_json(), *shape.values())
            exported = self._exported.setdefault(key, {})
            if case.dtype not in exported:
                cached = self.cache.load(key, case.dtype, mask is not None)
                if cached is not None:
                    exported[case.dtype] = cached
                elif case.dtype in EXPORT_DTYPES:  # every dtype of this structure, from one export
                    self.exports += 1
                    models = export_models(case.config, EXPORT_DTYPES, **shape)
                    exported.update(models)
                    self.cache.store(key, models)
                else:
                    self.exports += 1
                    exported[case.dtype] = export_model(case.config, case.dtype, **shape)
            model = replace_initializers(exported[case.dtype], canonical_to_initializers(case.weights, case.dtype))
        return model, input_feed(case, mask=mask)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        model, feed = self.model(case)
        self.sessions += 1
        results = ort_session(model, self.threads).run(list(STAGES), feed)
        return dict(zip(STAGES, results))


# -- the TorchScript exporter (torch-onnx-legacy) --------------------------------------


def legacy_initializers_to_canonical(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """A TorchScript export's weights -> canonical float64 weights.

    The folded weight of a projection is the second input of the ``MatMul`` that reads the
    graph input ``query`` (``w_q``), ``key`` (``w_k``), ``value`` (``w_v``), or anything else
    (``w_o``, which reads the concatenated heads); it is already ``(in, out)``.  Biases are
    ``q_proj.bias`` … by name.
    """
    graph = model.graph
    arrays = onnx_backend.weights_out(graph)
    by_input = {"query": "w_q", "key": "w_k", "value": "w_v"}
    out: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in arrays:
            name = by_input.get(node.input[0], "w_o")
            if name in out:
                raise ValueError(f"legacy export: two MatMul weights read as {name!r} ({node.input[1]!r})")
            out[name] = arrays[node.input[1]]
    for (_, b_name), prefix in LINEAR_NAMES.items():
        if f"{prefix}.bias" in arrays:
            out[b_name] = arrays[f"{prefix}.bias"]
    return out


class TorchOnnxLegacyAdapter(TorchOnnxAdapter):
    """The ``torch-onnx-legacy`` adapter: the same module exported by the TorchScript-based
    exporter (``dynamo=False``), once per case × dtype with the case's weights, run by
    onnxruntime's CPU provider.  The float64 scale stays a double here: no deviation."""

    name = "torch-onnx-legacy"
    known_deviations: list[Deviation] = []

    def __init__(self, *, opset: int = EXPORT_OPSET, threads: int = 1) -> None:
        import onnxruntime  # noqa: F401  (imported here, not in the first case's time budget)

        self.opset, self.optimize, self.threads = opset, False, threads
        self.exports = self.sessions = 0

    def model(self, case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The exported graph (with the case's weights), and its input feed."""
        mask = keep_mask(case)
        self.exports += 1
        model = export_model_legacy(case.config, case.dtype, case.weights, batch=case.batch, tgt_len=case.tgt_len,
                                    src_len=case.src_len, mask_shape=None if mask is None else mask.shape,
                                    opset=self.opset)
        return model, input_feed(case, mask=mask)
