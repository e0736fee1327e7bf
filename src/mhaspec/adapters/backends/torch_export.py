"""The export machinery of the ``torch-onnx`` adapters: :class:`~mhaspec.adapters.torch_layer.MultiHeadAttention`
exported to ONNX by ``torch.onnx.export``, quietly, on one thread, the torchlib registry built
once per process, several dtypes side by side in one export, and the exported graphs cached on
disk (:class:`ExportCache`).

``dynamo=True`` (:func:`export_model`, :func:`export_models`): the module exported once per
structure with zero weights; the adapter writes each case's weights into the initializers.
``dynamo=False`` (:func:`export_model_legacy`, the TorchScript-based exporter): once per case
with its weights.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import onnx
import torch

from ...protocol import contract as cache
from ...spec import STAGES, MHAConfig, Weights
from ..torch_layer import MultiHeadAttention
from .torch import dtype as torch_dtype
from .torch import weights_in

#: The opset the graph is exported for (the first with the standard Attention op; the
#: exported graph does not use it, but an SDPA-based module exported at this opset would).
EXPORT_OPSET = 23

_INPUTS = ("query", "key", "value", "mask")

#: The dtypes one export covers (:func:`export_models`): those onnxruntime's CPU provider runs.
EXPORT_DTYPES = ("float64", "float32", "float16")


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
        module.load_state_dict(weights_in(weights))
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
    kwargs: dict[str, Any] = {}
    if mask_shape is not None:
        kwargs["mask"] = args.pop()
    return _export(_module(config, dtype, weights, cls=_StagesTuple), tuple(args), kwargs,  # the eight, not lse
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
    from .. import torch_layer
    from . import torch as backend

    return cache.source_digest(torch_layer.__file__, __file__, backend.__file__)


class ExportCache:
    """Exported graphs (zero weights) on disk, one ONNX file per structure × dtype, under
    ``mhaspec.protocol.contract.cache_dir("torch-onnx")`` (``MHASPEC_CACHE_DIR``; ``off`` switches it off).

    The key is everything an export depends on: the installed torch, onnxscript and onnx,
    the source of :mod:`..torch_layer`, this module and :mod:`.torch`, the config,
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
