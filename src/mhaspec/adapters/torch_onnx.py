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
built once per process (:func:`_registry_reused`).  Each case's weights are
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

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from ..protocol import contract as cache
from ..protocol.contract import Deviation
from ..spec import STAGES, Case, MHAConfig, Weights
from ._onnx_common import ORT_NO_BFLOAT16, initializer_arrays, ort_session, replace_initializers, to_dtype
from ._torch_common import LINEAR_NAMES, linear_from_state_dict, linear_to_state_dict, torch_dtype
from .torch_layer import MultiHeadAttention

#: The opset the graph is exported for (the first with the standard Attention op; the
#: exported graph does not use it, but an SDPA-based module exported at this opset would).
EXPORT_OPSET = 23

_INPUTS = ("query", "key", "value", "mask")

#: The dtypes one export covers (:func:`export_models`): those onnxruntime's CPU provider runs.
EXPORT_DTYPES = ("float64", "float32", "float16")

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
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread while exporting (process-wide; restored after).

    The exporters run the module on the example inputs (the TorchScript tracer eagerly,
    torch.export on fake tensors); on these small tensors a second thread only spins:
    the legacy catalog run took 5.6 s of CPU with torch's default two threads here, 3.9 s
    with one.  What is judged is computed by onnxruntime, not by these calls."""
    threads = torch.get_num_threads()
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)


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


def _module(config: MHAConfig, dtype: str, weights: Weights | Mapping[str, Any] | None,
            cls: type[MultiHeadAttention] = MultiHeadAttention) -> MultiHeadAttention:
    """:class:`MultiHeadAttention` for ``config`` in ``dtype`` with ``weights`` (default: zeros), in eval mode."""
    module = torch.nn.utils.skip_init(cls, **config.model_dump(), dtype=torch_dtype(dtype))
    if weights is None:
        module.load_state_dict({k: torch.zeros_like(v) for k, v in module.state_dict().items()})
    else:
        module.load_state_dict(linear_to_state_dict(weights))
    return module.eval()


def _example(config: MHAConfig, dtype: str, batch: int, tgt_len: int, src_len: int,
             mask_shape: tuple[int, ...] | None) -> list[torch.Tensor]:
    """Example ``query, key, value[, mask]`` (zeros, all-True mask) of the export's sizes."""
    tdt = torch_dtype(dtype)
    kdim, vdim = int(config.kdim), int(config.vdim)  # type: ignore[arg-type]
    args = [
        torch.zeros(batch, tgt_len, config.d_model, dtype=tdt),
        torch.zeros(batch, src_len, kdim, dtype=tdt),
        torch.zeros(batch, src_len, vdim, dtype=tdt),
    ]
    if mask_shape is not None:
        args.append(torch.ones(mask_shape, dtype=torch.bool))
    return args


#: torchlib registries built by :func:`_registry_reused`, by opset (this process only).
_REGISTRIES: dict[Any, Any] = {}


@contextlib.contextmanager
def _registry_reused() -> Iterator[None]:
    """Within this block, ``torch.onnx.export`` builds its torchlib registry once per opset.

    ``torch.onnx.export`` calls ``ONNXRegistry.from_torchlib(opset_version=…)`` on every
    export, which re-parses the source of ~500 onnxscript functions: about half of one
    export here.  The registry depends on the installed torch and onnxscript and the opset
    alone, so the first one is kept (in this process) and handed back; the export is
    otherwise the public call.  tests/frameworks/test_onnx.py checks that the graph is the
    same as without the reuse.  A torch without this private hook exports unchanged.
    """
    try:
        from torch.onnx._internal.exporter import _registration

        cls = _registration.ONNXRegistry
        original = cls.__dict__["from_torchlib"]
        build = original.__func__
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(klass: Any, *args: Any, **kwargs: Any) -> Any:
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build(klass, *args, **kwargs)
        return _REGISTRIES[key]

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = original


def _export(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], input_names: list[str],
            output_names: list[str], opset: int, optimize: bool) -> onnx.ModelProto:
    """``torch.onnx.export(dynamo=True)`` in memory, quietly, the torchlib registry reused."""
    with _quiet(), _one_thread(), _registry_reused():
        program = torch.onnx.export(
            module, args, kwargs=kwargs, dynamo=True, opset_version=opset, optimize=optimize, verbose=False,
            input_names=input_names, output_names=output_names,
        )
    return program.model_proto


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
    args = _example(config, dtype, batch, tgt_len, src_len, mask_shape)
    kwargs: dict[str, Any] = {"return_stages": True}
    if mask_shape is not None:
        kwargs["mask"] = args.pop()
    return _export(_module(config, dtype, weights), tuple(args), kwargs,
                   list(_INPUTS[: 3 + (mask_shape is not None)]), list(STAGES), opset, optimize)


class _SideBySide(torch.nn.Module):
    """One :class:`MultiHeadAttention` per dtype, called one after the other with its own
    inputs: one ``torch.onnx.export`` traces them all.  Parameters are named
    ``by_dtype.float32.q_proj.weight`` …, inputs ``float32.query`` …, outputs ``float32.scores`` …"""

    def __init__(self, modules: Mapping[str, MultiHeadAttention], masked: bool) -> None:
        super().__init__()
        self.by_dtype = torch.nn.ModuleDict(dict(modules))
        self.masked = masked

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = 3 + self.masked
        out: list[torch.Tensor] = []
        for i, module in enumerate(self.by_dtype.values()):
            q, k, v, *mask = inputs[n * i: n * (i + 1)]
            stages = module(q, k, v, mask[0] if mask else None, return_stages=True)
            out.extend(stages[s] for s in STAGES)
        return tuple(out)


def export_models(
    config: MHAConfig,
    dtypes: tuple[str, ...] = EXPORT_DTYPES,
    *,
    batch: int,
    tgt_len: int,
    src_len: int,
    mask_shape: tuple[int, ...] | None = None,
    opset: int = EXPORT_OPSET,
) -> dict[str, onnx.ModelProto]:
    """:func:`export_model` for each of ``dtypes`` (zero weights), from ONE ``torch.onnx.export``.

    The modules of every dtype are exported side by side in one graph (about 1.0 s of CPU
    here for three, against 0.5 s for one: most of an export's time does not grow with
    the module), then the graph is cut into one model per dtype with
    :func:`split_side_by_side`: the exporter's nodes for that dtype, untouched, with the
    ``{dtype}.`` (parameters: ``by_dtype.{dtype}.``) prefix taken off the names.
    tests/frameworks/test_onnx.py checks that each is, node for node, the graph
    :func:`export_model` gives for that dtype alone.
    """
    masked = mask_shape is not None
    modules = {dtype: _module(config, dtype, None) for dtype in dtypes}
    args = [a for dtype in dtypes for a in _example(config, dtype, batch, tgt_len, src_len, mask_shape)]
    names = list(_INPUTS[: 3 + masked])
    combined = _export(_SideBySide(modules, masked), tuple(args), {},
                       [f"{d}.{n}" for d in dtypes for n in names], [f"{d}.{s}" for d in dtypes for s in STAGES],
                       opset, False)
    return {dtype: split_side_by_side(combined, dtype) for dtype in dtypes}


def split_side_by_side(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """The part of a side-by-side export (:func:`export_models`) that computes ``{dtype}.*``.

    Keeps the nodes the ``{dtype}.`` outputs depend on, in the graph's order, the
    initializers and value infos they use, and renames ``{dtype}.x`` (inputs, outputs) and
    ``by_dtype.{dtype}.x`` (parameters) to ``x``; nothing else changes.
    """
    prefix = dtype + "."
    graph = model.graph
    outputs = [o for o in graph.output if o.name.startswith(prefix)]
    needed = {o.name for o in outputs}
    keep = [False] * len(graph.node)
    for i in range(len(graph.node) - 1, -1, -1):  # the exporter writes nodes in topological order
        node = graph.node[i]
        if any(name in needed for name in node.output):
            keep[i] = True
            needed.update(name for name in node.input if name)
            for attr in node.attribute:
                if attr.g.node or attr.graphs:
                    raise ValueError("split_side_by_side: subgraphs (If/Loop) are not expected in this export")

    param = f"by_dtype.{dtype}."  # the parameters' names: by_dtype.float32.q_proj.weight

    def rename(name: str) -> str:
        for head in (prefix, param):
            if name.startswith(head):
                return name[len(head):]
        return name

    sub = onnx.helper.make_graph(
        [n for n, k in zip(graph.node, keep) if k], graph.name,
        [i for i in graph.input if i.name in needed], outputs,
        initializer=[t for t in graph.initializer if t.name in needed],
        value_info=[v for v in graph.value_info if v.name in needed],
    )
    for node in sub.node:
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    for value in (*sub.input, *sub.output, *sub.initializer, *sub.value_info):
        value.name = rename(value.name)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.CopyFrom(sub)
    return out


# -- the export cache ----------------------------------------------------------------------


def _export_source() -> str:
    """sha256 of the code an export depends on: the module, its export and its dtype helpers."""
    from . import _torch_common, torch_layer

    return cache.source_digest(torch_layer.__file__, __file__, _torch_common.__file__)


class ExportCache:
    """Exported graphs (zero weights) on disk, one ONNX file per structure × dtype, under
    ``mhaspec.protocol.contract.cache_dir("torch-onnx")`` (``MHASPEC_CACHE_DIR``; ``off`` switches it off).

    The key is everything an export depends on: the installed torch, onnxscript and onnx,
    the source of :mod:`.torch_layer`, this module and :mod:`._torch_common`, the config,
    the sizes, the mask's shape, the opset and the dtypes exported side by side.  A file
    is the exporter's own graph as :func:`export_models` cut it, written atomically; one
    that does not parse or does not have the expected inputs and outputs is ignored and
    exported again.  tests/frameworks/test_onnx.py checks that a cached graph is byte for
    byte the one exported, and that the stages are identical.
    """

    def __init__(self, folder: Path | None = None, *, enabled: bool = True) -> None:
        """``folder`` (default: the cache directory's ``torch-onnx``); ``enabled=False``: no cache."""
        import onnxscript

        self.folder = (cache.cache_dir("torch-onnx") if folder is None else folder) if enabled else None
        self._versions = (torch.__version__, onnxscript.__version__, onnx.__version__, _export_source())
        self.hits = self.writes = 0

    def _path(self, key: tuple, dtype: str) -> Path:
        return self.folder / f"{cache.key_digest('torch-onnx', self._versions, EXPORT_DTYPES, key)}.{dtype}.onnx"

    def load(self, key: tuple, dtype: str, masked: bool) -> onnx.ModelProto | None:
        """The cached graph of ``key`` in ``dtype``, or None (not cached, unreadable, not this graph)."""
        if self.folder is None:
            return None
        data = cache.cache_read(self._path(key, dtype))
        if data is None:
            return None
        try:
            model = onnx.load_from_string(data)
        except Exception:  # noqa: BLE001 - a damaged file is a miss, never an error
            return None
        graph = model.graph
        if ([o.name for o in graph.output] != list(STAGES)
                or [i.name for i in graph.input] != list(_INPUTS[: 3 + masked])):
            return None
        self.hits += 1
        return model

    def store(self, key: tuple, models: Mapping[str, onnx.ModelProto]) -> None:
        if self.folder is None:
            return
        for dtype, model in models.items():
            self.writes += cache.cache_write(self._path(key, dtype), model.SerializeToString())


def case_mask(case: Case) -> np.ndarray | None:
    """The case's explicit mask as ``(B|1, 1, T, S)`` bool (True = may attend), or None."""
    mask = case.inputs.mask
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return np.ascontiguousarray(np.broadcast_to(mask, mask.shape[:2] + (case.tgt_len, case.src_len)), dtype=bool)


def _feed(case: Case, mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """The graph's inputs for ``case``: ``query, key, value`` in the case's dtype[, ``mask``]."""
    query = to_dtype(case.inputs.query, case.dtype)
    feed = {
        "query": query,
        "key": query if case.self_attention else to_dtype(case.inputs.key, case.dtype),
        "value": query if case.self_attention else to_dtype(case.inputs.value, case.dtype),
    }
    if mask is not None:
        feed["mask"] = mask
    return feed


class TorchOnnxAdapter:
    """The ``torch-onnx`` adapter: the exported ``torch`` module on onnxruntime's CPU provider."""

    name = "torch-onnx"
    framework = "torch"
    known_deviations = [Deviation(_SCALE_F32, dtype="float64", stage=s, within="float32")
                        for s in ("scores", "attn_weights", "head_outputs", "concat", "output")]

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
        mask = case_mask(case)
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
        return model, _feed(case, mask)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        model, feed = self.model(case)
        self.sessions += 1
        results = ort_session(model, self.threads).run(list(STAGES), feed)
        return dict(zip(STAGES, results))


# -- the TorchScript exporter (torch-onnx-legacy) --------------------------------------


class _StagesTuple(MultiHeadAttention):
    """:class:`MultiHeadAttention` whose ``forward(query, key, value[, mask])`` returns the eight
    stages as a tuple (the TorchScript exporter takes positional inputs and flat outputs)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        stages = super().forward(query, key, value, mask, return_stages=True)
        return tuple(stages[s] for s in STAGES)  # type: ignore[index]


def export_model_legacy(
    config: MHAConfig,
    dtype: str,
    weights: Weights | Mapping[str, Any],
    *,
    batch: int,
    tgt_len: int,
    src_len: int,
    mask_shape: tuple[int, ...] | None = None,
    opset: int = EXPORT_OPSET,
) -> onnx.ModelProto:
    """:class:`MultiHeadAttention` for ``config`` in ``dtype`` with ``weights``, exported by the
    TorchScript-based exporter, ``torch.onnx.export(..., dynamo=False)`` (deprecated since
    torch 2.9, still there in 2.13); inputs ``query, key, value[, mask]``, outputs the eight stages.

    The exporter folds constants: each weight's transpose becomes an initializer of its
    own (``onnx::MatMul_N``, canonical layout ``(in, out)``); the biases keep their
    parameter names.  :func:`legacy_initializers_to_canonical` reads them back.
    """
    module = _module(config, dtype, weights, _StagesTuple)
    args = _example(config, dtype, batch, tgt_len, src_len, mask_shape)
    buffer = io.BytesIO()
    with _quiet(), _one_thread():
        torch.onnx.export(module, tuple(args), buffer, dynamo=False, opset_version=opset,
                          input_names=list(_INPUTS[: len(args)]), output_names=list(STAGES))
    return onnx.load_from_string(buffer.getvalue())


def legacy_initializers_to_canonical(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """A TorchScript export's weights -> canonical float64 weights.

    The folded weight of a projection is the second input of the ``MatMul`` that reads the
    graph input ``query`` (``w_q``), ``key`` (``w_k``), ``value`` (``w_v``), or anything else
    (``w_o``, which reads the concatenated heads); it is already ``(in, out)``.  Biases are
    ``q_proj.bias`` … by name.
    """
    graph = model.graph
    arrays = initializer_arrays(graph)
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
        mask = case_mask(case)
        self.exports += 1
        model = export_model_legacy(case.config, case.dtype, case.weights, batch=case.batch, tgt_len=case.tgt_len,
                                    src_len=case.src_len, mask_shape=None if mask is None else mask.shape,
                                    opset=self.opset)
        return model, _feed(case, mask)
