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

The graph is exported once per structure (config, dtype, B, T, S, mask shape)
with zero weights and kept; each case's weights are written into its
initializers by :func:`canonical_to_initializers` (the ``nn.Linear`` layout:
``q_proj.weight = w_q.T`` …), so a wrong converter fails the run.
``optimize=False`` keeps the initializers under the module's parameter names
(the default optimizer folds the weight transposes into new initializers
named ``val_N``); onnxruntime folds those Transpose nodes itself when it loads
the graph.  tests/frameworks/test_onnx.py checks that the optimized export
computes bit-identical stages.

The mask is the spec's (True = may attend), ``(B|1, 1, T, S)``; the module
ANDs the causal mask in, in the config's alignment.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import onnx
import torch

from ..spec import STAGES, Case, MHAConfig, Weights
from ._onnx_common import ORT_NO_BFLOAT16, initializer_arrays, ort_session, replace_initializers, to_dtype
from ._torch_common import LINEAR_NAMES, linear_from_state_dict, linear_to_state_dict, torch_dtype
from .base import Deviation
from .torch_layer import MultiHeadAttention

#: The opset the graph is exported for (the first with the standard Attention op; the
#: exported graph does not use it, but an SDPA-based module exported at this opset would).
EXPORT_OPSET = 23

_INPUTS = ("query", "key", "value", "mask")

_SCALE_F32 = (
    "torch.onnx.export writes the Python float scale of `scores = (Q @ K^T) * scale` as a float32 Constant "
    "cast to double (torch/onnx/_internal/exporter/_building.py _determine_input_dtype: a Python float "
    "with no bound dtype is ir.DataType.FLOAT; onnxscript torch_lib aten_scalar_tensor then Casts it), "
    "so a float64 graph scales by float32(scale): scores off by up to ~3e-8 relative whenever float32 "
    "cannot hold 1/sqrt(D_k), and every later stage with them (eager torch keeps the scale in float64)"
)


def canonical_to_initializers(weights: Weights | Mapping[str, Any], dtype: str = "float64") -> list[onnx.TensorProto]:
    """Canonical weights -> the exported graph's initializers in ``dtype``.

    Names and layout are the module's ``state_dict``: ``q_proj.weight = w_q.T
    (H·D_k, d_model)``, ``k_proj.weight = w_k.T``, ``v_proj.weight = w_v.T``,
    ``out_proj.weight = w_o.T (d_out, H·D_v)``, ``*.bias = b_*``.
    """
    from onnx import numpy_helper

    state = linear_to_state_dict(weights)
    return [numpy_helper.from_array(to_dtype(t.numpy(), dtype), name) for name, t in state.items()]


def initializers_to_canonical(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The exported graph's parameter initializers -> canonical float64 weights."""
    names = [f"{prefix}.{kind}" for prefix in LINEAR_NAMES.values() for kind in ("weight", "bias")]
    found = initializer_arrays(model.graph, names)
    return linear_from_state_dict({k: torch.from_numpy(v) for k, v in found.items()})


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporter's warnings and notices (its progress lines: ``verbose=False``).

    Log levels and warning filters are process-wide; stdout is left alone (the runner
    prints rows from another thread)."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_model(
    config: MHAConfig,
    dtype: str,
    *,
    batch: int,
    tgt_len: int,
    src_len: int,
    mask_shape: tuple[int, ...] | None = None,
    weights: Weights | Mapping[str, Any] | None = None,
    opset: int = EXPORT_OPSET,
    optimize: bool = False,
) -> onnx.ModelProto:
    """:class:`MultiHeadAttention` for ``config`` in ``dtype`` with ``weights`` (default: zeros),
    exported with ``torch.onnx.export(dynamo=True)``; inputs ``query, key, value[, mask]``,
    outputs the eight stages by name."""
    tdt = torch_dtype(dtype)
    module = torch.nn.utils.skip_init(MultiHeadAttention, **config.model_dump(), dtype=tdt)
    if weights is None:
        module.load_state_dict({k: torch.zeros_like(v) for k, v in module.state_dict().items()})
    else:
        module.load_state_dict(linear_to_state_dict(weights))
    module.eval()
    kdim, vdim = int(config.kdim), int(config.vdim)  # type: ignore[arg-type]
    args = (
        torch.zeros(batch, tgt_len, config.d_model, dtype=tdt),
        torch.zeros(batch, src_len, kdim, dtype=tdt),
        torch.zeros(batch, src_len, vdim, dtype=tdt),
    )
    kwargs: dict[str, Any] = {"return_stages": True}
    if mask_shape is not None:
        kwargs["mask"] = torch.ones(mask_shape, dtype=torch.bool)
    with _quiet():
        program = torch.onnx.export(
            module, args, kwargs=kwargs, dynamo=True, opset_version=opset, optimize=optimize, verbose=False,
            input_names=list(_INPUTS[: 3 + (mask_shape is not None)]), output_names=list(STAGES),
        )
    return program.model_proto


def case_mask(case: Case) -> np.ndarray | None:
    """The case's explicit mask as ``(B|1, 1, T, S)`` bool (True = may attend), or None."""
    mask = case.inputs.mask
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return np.ascontiguousarray(np.broadcast_to(mask, mask.shape[:2] + (case.tgt_len, case.src_len)), dtype=bool)


class TorchOnnxAdapter:
    """The ``torch-onnx`` adapter: the exported ``torch`` module on onnxruntime's CPU provider."""

    name = "torch-onnx"
    framework = "torch"
    known_deviations = [Deviation(_SCALE_F32, dtype="float64", stage=s)
                        for s in ("scores", "attn_weights", "head_outputs", "concat", "output")]

    def __init__(self, *, opset: int = EXPORT_OPSET, optimize: bool = False, threads: int = 1) -> None:
        """``optimize=True`` exports as ``torch.onnx.export`` does by default (onnxscript's optimizer
        folds the weight transposes), once per case with its weights: slower, the same stages."""
        import onnxruntime  # noqa: F401  (imported here, not in the first case's time budget)
        import onnxscript  # noqa: F401  (what torch.onnx.export translates with)

        self.opset, self.optimize, self.threads = opset, optimize, threads
        self._exported: dict[tuple, onnx.ModelProto] = {}

    def supports(self, case: Case) -> bool | str:
        if case.dtype == "bfloat16":
            return ORT_NO_BFLOAT16
        return True

    def model(self, case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
        """The exported graph with the case's weights, and its input feed."""
        mask = case_mask(case)
        shape = dict(batch=case.batch, tgt_len=case.tgt_len, src_len=case.src_len,
                     mask_shape=None if mask is None else mask.shape, opset=self.opset)
        if self.optimize:  # the optimizer renames the folded weights: export with the case's own
            model = export_model(case.config, case.dtype, weights=case.weights, optimize=True, **shape)
        else:
            key = (case.config.model_dump_json(), case.dtype, *shape.values())
            exported = self._exported.get(key)
            if exported is None:
                exported = self._exported[key] = export_model(case.config, case.dtype, **shape)
            model = replace_initializers(exported, canonical_to_initializers(case.weights, case.dtype))
        query = to_dtype(case.inputs.query, case.dtype)
        feed = {
            "query": query,
            "key": query if case.self_attention else to_dtype(case.inputs.key, case.dtype),
            "value": query if case.self_attention else to_dtype(case.inputs.value, case.dtype),
        }
        if mask is not None:
            feed["mask"] = mask
        return model, feed

    def run(self, case: Case) -> dict[str, np.ndarray]:
        model, feed = self.model(case)
        results = ort_session(model, self.threads).run(list(STAGES), feed)
        return dict(zip(STAGES, results))
