"""Finding an adapter by name: the built-in adapters, ``package.module:attr``, ``path/to/file.py:attr``.

A built-in adapter is imported only when used; what it needs is checked first,
so that a missing framework is named with the pip extra that installs it
(``missing onnxscript: pip install 'mhaspec[onnx]'``), as ``mhaspec adapters`` lists it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AdapterError
from .ranks import is_distributed


@dataclass(frozen=True)
class BuiltinAdapter:
    """A built-in adapter: imported only when used."""

    name: str
    target: str  # "module:attr"
    framework: str  # the distribution it needs
    description: str
    requires: tuple[str, ...] = ()  # further modules it needs besides the framework

    @property
    def extra(self) -> str:
        """The pip extra(s) that install what it needs."""
        extras = dict.fromkeys(_extra(m) for m in (self.framework, *self.requires))
        return ",".join(extras)

    @property
    def modules(self) -> tuple[str, ...]:
        """The top-level modules it imports: its framework's, then the further ones."""
        return (self.framework, *self.requires)

    def missing(self) -> list[str]:
        """The modules of :attr:`modules` that cannot be imported here (not installed)."""
        return [m for m in self.modules if not _importable(m)]


BUILTINS: dict[str, BuiltinAdapter] = {
    b.name: b
    for b in [
        BuiltinAdapter("numpy", "mhaspec.adapters.numpy_mha:NumpyMHA", "numpy",
                       "MHA written in numpy, every stage, any dtype (bfloat16 via ml_dtypes)"),
        BuiltinAdapter("torch", "mhaspec.adapters.torch_layer:TorchMHAAdapter", "torch",
                       "torch.nn.Module with four nn.Linear (W^Q, W^K, W^V, W^O), every stage"),
        BuiltinAdapter("torch-mha", "mhaspec.adapters.torch_mha:TorchMultiheadAttentionAdapter", "torch",
                       "torch.nn.MultiheadAttention, need_weights=True (per-head weights)"),
        BuiltinAdapter("torch-mha-fast", "mhaspec.adapters.torch_mha:TorchMultiheadAttentionFastAdapter", "torch",
                       "torch.nn.MultiheadAttention, need_weights=False (the production SDPA path)"),
        BuiltinAdapter("torch-sdpa", "mhaspec.adapters.torch_sdpa:TorchSDPAAdapter", "torch",
                       "torch.nn.functional.scaled_dot_product_attention between nn.Linear projections"),
        BuiltinAdapter("torch-flex", "mhaspec.adapters.torch_flex:TorchFlexAdapter", "torch",
                       "torch.nn.attention.flex_attention (score_mod, block_mask, lse) between nn.Linear; forward only"),
        BuiltinAdapter("keras", "mhaspec.adapters.keras_mha:KerasMHAAdapter", "keras",
                       "keras.layers.MultiHeadAttention / GroupQueryAttention, default (fused) path"),
        BuiltinAdapter("keras-scores", "mhaspec.adapters.keras_mha:KerasMHAScoresAdapter", "keras",
                       "keras.layers.MultiHeadAttention with return_attention_scores=True"),
        BuiltinAdapter("keras-dpa", "mhaspec.adapters.keras_dpa:KerasDPAAdapter", "keras",
                       "keras.ops.dot_product_attention between keras.ops projections (TensorFlow backend)"),
        BuiltinAdapter("keras-hub-cached", "mhaspec.adapters.keras_hub_cached:KerasHubCachedAdapter", "keras_hub",
                       "keras_hub.layers.CachedMultiHeadAttention: decode through its cache, keras-hub's causal mask"),
        BuiltinAdapter("hf-llama-cache", "mhaspec.adapters.hf_llama_cache:HFLlamaCacheAdapter", "transformers",
                       "transformers' LlamaAttention (SDPA) with DynamicCache, the mask create_causal_mask builds per call"),
        BuiltinAdapter("tensorflow", "mhaspec.adapters.tf_ops:TensorFlowMHAAdapter", "tensorflow",
                       "MHA written with plain TensorFlow ops, every stage"),
        BuiltinAdapter("jax", "mhaspec.adapters.jax_numpy:JaxMHAAdapter", "jax",
                       "MHA written with jax.numpy, jit-compiled, every stage"),
        BuiltinAdapter("jax-dpa", "mhaspec.adapters.jax_dpa:JaxDPAAdapter", "jax",
                       "jax.nn.dot_product_attention between jnp projections"),
        BuiltinAdapter("jax-tp", "mhaspec.adapters.jax_ranks:JaxTensorParallelAdapter", "jax",
                       "distributed: jax.shard_map over tp devices, column-parallel Q/K/V, row-parallel W^O, psum"),
        BuiltinAdapter("jax-ring", "mhaspec.adapters.jax_ranks:JaxRingAdapter", "jax",
                       "distributed: jax.shard_map ring attention over cp devices (ppermute, LSE merge), contiguous"),
        BuiltinAdapter("jax-ring-zigzag", "mhaspec.adapters.jax_ranks:JaxRingZigzagAdapter", "jax",
                       "distributed: the jax-ring with zigzag chunks (rank c: chunks c and 2cp - 1 - c)"),
        BuiltinAdapter("flax-linen", "mhaspec.adapters.flax_linen:FlaxLinenAdapter", "flax",
                       "flax.linen.MultiHeadDotProductAttention"),
        BuiltinAdapter("flax-nnx", "mhaspec.adapters.flax_nnx:FlaxNNXAdapter", "flax",
                       "flax.nnx.MultiHeadAttention, sow_weights=True (attention weights exposed)"),
        BuiltinAdapter("flax-nnx-fast", "mhaspec.adapters.flax_nnx:FlaxNNXFastAdapter", "flax",
                       "flax.nnx.MultiHeadAttention, sow_weights=False (the production dot_product_attention path)"),
        BuiltinAdapter("onnxruntime", "mhaspec.adapters.onnx_attention:OnnxRuntimeAdapter", "onnxruntime",
                       "the standard ONNX Attention op (opset 23) between MatMul projections, onnxruntime CPU",
                       requires=("onnx",)),
        BuiltinAdapter("onnx-reference", "mhaspec.adapters.onnx_attention:OnnxReferenceAdapter", "onnx",
                       "the same ONNX graph run by onnx.reference.ReferenceEvaluator"),
        BuiltinAdapter("torch-onnx", "mhaspec.adapters.torch_onnx:TorchOnnxAdapter", "torch",
                       "the torch adapter's module exported by torch.onnx.export (dynamo), run by onnxruntime",
                       requires=("onnx", "onnxruntime", "onnxscript")),
        BuiltinAdapter("torch-onnx-legacy", "mhaspec.adapters.torch_onnx:TorchOnnxLegacyAdapter", "torch",
                       "the same module exported by the TorchScript exporter (dynamo=False), run by onnxruntime",
                       requires=("onnx", "onnxruntime")),
        BuiltinAdapter("numpy-tp", "mhaspec.adapters.numpy_ranks:NumpyTP", "numpy",
                       "distributed (threads): heads across ranks, column-parallel QKV, row-parallel W^O, all-reduce"),
        BuiltinAdapter("numpy-ring", "mhaspec.adapters.numpy_ranks:NumpyRing", "numpy",
                       "distributed (threads): ring attention over contiguous chunks, send/recv and an LSE merge"),
        BuiltinAdapter("numpy-ring-zigzag", "mhaspec.adapters.numpy_ranks:NumpyRingZigzag", "numpy",
                       "distributed (threads): ring attention over the zigzag partition"),
        BuiltinAdapter("numpy-ulysses", "mhaspec.adapters.numpy_ranks:NumpyUlysses", "numpy",
                       "distributed (threads): Ulysses, all-to-all of rows for heads and back"),
        BuiltinAdapter("numpy-allgather", "mhaspec.adapters.numpy_ranks:NumpyAllgather", "numpy",
                       "distributed (threads): every rank all-gathers the keys and values"),
        BuiltinAdapter("torch-tp", "mhaspec.adapters.torch_ranks:TorchTensorParallel", "torch",
                       "DTensor tensor parallelism (ColwiseParallel q/k/v, RowwiseParallel out) on torch.distributed"),
        BuiltinAdapter("torch-ring", "mhaspec.adapters.torch_ranks:TorchRing", "torch",
                       "ring attention on torch.distributed: batch_isend_irecv, LSE merge, contiguous chunks"),
        BuiltinAdapter("torch-ring-zigzag", "mhaspec.adapters.torch_ranks:TorchRingZigzag", "torch",
                       "the same ring with zigzag chunks (rank c owns chunks c and 2·cp − 1 − c)"),
        BuiltinAdapter("torch-ulysses", "mhaspec.adapters.torch_ranks:TorchUlysses", "torch",
                       "Ulysses on torch.distributed: all_to_all_single trades rows for heads and back"),
    ]
}


def _import_target(target: str, what: str) -> Any:
    """Resolve ``package.module:attr`` or ``path/to/file.py:attr``."""
    if ":" not in target:
        raise AdapterError(
            f"unknown adapter {what!r}: not a built-in name ({', '.join(BUILTINS)}), "
            "nor of the form package.module:attr or path/to/file.py:attr"
        )
    module_part, attr = target.rsplit(":", 1)
    if not attr:
        raise AdapterError(f"adapter {what!r}: missing attribute after ':'")
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise AdapterError(f"adapter {what!r}: file {path} does not exist")
        mod_name = f"_mhaspec_user_adapter_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise AdapterError(f"adapter {what!r}: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        folder = str(path.resolve().parent)  # its neighbours import as they would with `python file.py`
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise AdapterError(f"adapter {what!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise AdapterError(f"adapter {what!r}: cannot import {module_part} ({exc})") from exc
        except Exception as exc:
            raise AdapterError(f"adapter {what!r}: importing {module_part} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise AdapterError(
            f"adapter {what!r}: {module_part} has no attribute {attr!r}; it has: {', '.join(public)}"
        ) from None


def load_adapter(ref: Any, **options: Any) -> Any:
    """An adapter from a built-in name, ``package.module:attr``, ``file.py:attr`` or an object.

    A class is instantiated with ``options`` (e.g. ``device="cuda"``); an
    instance is used as it is (options must then be empty).
    """
    builtin = BUILTINS.get(ref) if isinstance(ref, str) else None
    if builtin is not None:
        # what it needs is checked before anything is imported: a module the adapter imports only when
        # constructed or at its first run() is named here, with the extra that installs it, not in a case's error
        missing = builtin.missing()
        if missing:
            raise AdapterError(f"built-in adapter {ref!r} is not usable here: {missing_hint(missing, builtin)}")
        try:
            obj = _import_target(builtin.target, ref)
        except AdapterError as exc:
            absent = _missing_module(exc.__cause__)
            if absent is None:
                raise AdapterError(f"built-in adapter {ref!r} is not usable here: {exc}") from None
            raise AdapterError(f"built-in adapter {ref!r} is not usable here: importing {builtin.target.split(':')[0]} "
                               f"raised {_describe_missing(exc.__cause__)}; {missing_hint([absent], builtin)}") from None
        label = ref
    elif isinstance(ref, str):
        obj = _import_target(ref, ref)
        label = ref
    else:
        obj, label = ref, repr(ref)
    options = {k: v for k, v in options.items() if v is not None}
    if inspect.isclass(obj):
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            params = {}
        unknown = [k for k in options if k not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())]
        if unknown:
            raise AdapterError(f"adapter {label}: does not take option(s) {', '.join(unknown)}")
        try:
            obj = obj(**options)
        except ModuleNotFoundError as exc:
            absent = _missing_module(exc)
            if builtin is not None and absent is not None:
                raise AdapterError(f"built-in adapter {label!r} is not usable here: constructing it raised "
                                   f"{_describe_missing(exc)}; {missing_hint([absent], builtin)}") from exc
            which = f"missing module {absent!r} " if absent else ""
            raise AdapterError(f"adapter {label}: constructing it failed: {which}({type(exc).__name__}: {exc})") from exc
        except Exception as exc:
            raise AdapterError(f"adapter {label}: constructing it failed: {type(exc).__name__}: {exc}") from exc
    elif options:
        raise AdapterError(f"adapter {label}: is an instance; option(s) {', '.join(options)} cannot be applied")
    if not callable(getattr(obj, "run", None)) and not is_distributed(obj):
        raise AdapterError(f"adapter {label}: has no run(case) method (nor run_rank(ctx, case): docs/distributed.md)")
    if not isinstance(getattr(obj, "name", None), str):
        raise AdapterError(f"adapter {label}: has no string attribute 'name'")
    return obj


#: the pip extra of mhaspec that installs a top-level module (pyproject.toml [project.optional-dependencies])
EXTRA_OF_MODULE = {
    "torch": "torch",
    "tensorflow": "tensorflow", "keras": "tensorflow",
    "keras_hub": "serving", "transformers": "serving",
    "jax": "jax", "jaxlib": "jax", "flax": "jax",
    "onnx": "onnx", "onnxruntime": "onnx", "onnxscript": "onnx", "onnx_ir": "onnx",
    "numpy": "bf16", "ml_dtypes": "bf16",
}

#: PyTorch's CPU wheel index: with it pip takes torch's CPU build (``2.13.0+cpu``), without it a CUDA
#: build of several GB on Linux (README, "Pinned versions")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: the extras that install torch (``serving``: transformers' adapter runs on it)
TORCH_EXTRAS = frozenset({"torch", "serving"})


def _extra(framework: str) -> str:
    return EXTRA_OF_MODULE.get(framework, framework)


def install_command(extras: Iterable[str]) -> str:
    """The pip command that installs mhaspec's ``extras``; torch from its CPU index, never a CUDA build."""
    extras = list(dict.fromkeys(extras))
    command = f"pip install 'mhaspec[{','.join(extras)}]'"
    return command + (f" --extra-index-url {TORCH_CPU_INDEX}" if TORCH_EXTRAS & set(extras) else "")


def missing_hint(missing: Iterable[str], builtin: BuiltinAdapter | None = None) -> str:
    """``missing onnxscript: pip install 'mhaspec[onnx]'``: the modules, and the extra that installs them.

    A module no extra names (a dependency of a dependency) gets the extras of ``builtin``: installing
    them again brings what they need.
    """
    missing = list(dict.fromkeys(missing))
    extras = [EXTRA_OF_MODULE[m] for m in missing if m in EXTRA_OF_MODULE]
    if len(extras) < len(missing) and builtin is not None:
        extras += builtin.extra.split(",")
    text = f"missing {', '.join(missing)}"
    return f"{text}: {install_command(extras)}" if extras else text


def _importable(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (found on the path, or already imported)."""
    try:
        return importlib.util.find_spec(module) is not None  # None also when sys.modules[module] is None
    except (ImportError, ValueError):
        return False


def _missing_module(exc: BaseException | None) -> str | None:
    """The top-level module a ``ModuleNotFoundError`` (or one it was raised from) could not find."""
    while exc is not None and not isinstance(exc, ModuleNotFoundError):
        exc = exc.__cause__
    if exc is None:
        return None
    name = exc.name or ""
    return name.split(".")[0] or None


def _describe_missing(exc: BaseException | None) -> str:
    while exc is not None and not isinstance(exc, ModuleNotFoundError):
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if exc is not None else ""


def builtin_status() -> list[tuple[BuiltinAdapter, bool, str]]:
    """For every built-in adapter: (entry, importable here, why not).

    "Why not" is what :func:`load_adapter` says when it refuses the adapter: the missing modules
    and the pip command that installs them (``missing onnxscript: pip install 'mhaspec[onnx]'``).
    Nothing is imported: a framework whose import itself fails shows only when the adapter is run.
    """
    rows = []
    for b in BUILTINS.values():
        module = b.target.split(":")[0]
        missing = b.missing()
        if missing:
            rows.append((b, False, missing_hint(missing, b)))
        elif importlib.util.find_spec(module) is None:
            rows.append((b, False, f"{module} is missing"))
        else:
            rows.append((b, True, ""))
    return rows
