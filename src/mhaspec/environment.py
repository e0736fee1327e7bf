"""Where a verdict was reached: the facts of a process that change which kernels compute.

Two runs of one adapter can round differently on two machines: another CPU
(AVX-512 or AMX kernels instead of AVX2 ones), oneDNN switched on or off,
another BLAS core type, other thread counts.  :func:`describe` reads those
facts — from ``/proc/cpuinfo`` (once per process), the environment variables,
numpy, threadpoolctl and the frameworks *already imported* — and returns them
as JSON-able data: every report carries them (docs/report.md, ``environment``),
read in the process that ran the adapter (the worker sends its own).

Nothing here imports a framework or starts a process: a framework that the
process has not imported is simply not described.  :func:`summary` is the
report's one-line header; :func:`differences` names what two sets of reports
disagree on (``mhaspec matrix`` warns with it).
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

#: The CPU flags that change which kernels the BLAS, oneDNN, XLA and the frameworks pick
#: (Linux's /proc/cpuinfo names), in the order they are listed.
KERNEL_FLAGS = (
    # x86
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma",
    "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16",
    "avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx_ifma",
    # arm64 (the "Features" line)
    "asimd", "asimdhp", "asimddp", "fphp", "bf16", "i8mm", "sve", "sve2", "svebf16", "svei8mm", "sme",
)

#: module -> the distributions it may be installed as (the first one found names it).
FRAMEWORKS = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tensorflow-macos", "tf-nightly"),
    "keras": ("keras",),
    "jax": ("jax",),
    "jaxlib": ("jaxlib",),
    "flax": ("flax",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino"),
    "onnxscript": ("onnxscript",),
}

#: Thread counts set through the environment (``threads``; null when unset).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

#: Other variables that change kernels or their numerics (``variables``, only those set).
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                    "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "XLA_FLAGS",
                    "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")

#: Where the facts were read: the adapter's worker process, the runner itself running the adapter
#: (``isolate=False``), the runner alone (no adapter ever ran, e.g. it could not be loaded), or the
#: runner for an adapter program (``exec:``; the program's own facts under ``program``).
PROCESSES = ("worker", "in-process", "runner", "exec")

_ARM_PARTS = {  # (implementer, part) of /proc/cpuinfo -> name (arm64 Linux gives no model name)
    ("0x41", "0xd0c"): "Arm Neoverse-N1", ("0x41", "0xd40"): "Arm Neoverse-V1", ("0x41", "0xd49"): "Arm Neoverse-N2",
    ("0x41", "0xd4f"): "Arm Neoverse-V2", ("0x41", "0xd8e"): "Arm Neoverse-N3", ("0x41", "0xd84"): "Arm Neoverse-V3",
    ("0x41", "0xd08"): "Arm Cortex-A72", ("0x41", "0xd0b"): "Arm Cortex-A76", ("0xc0", "0xac3"): "Ampere-1",
    ("0x50", "0x000"): "Ampere eMAG",
}


def describe(frameworks: Iterable[str] | None = None, process: str = "runner") -> dict[str, Any]:
    """This process's environment (keys in docs/report.md, ``environment``).

    ``frameworks``: the modules to describe (default: every one of :data:`FRAMEWORKS`); each is
    described only if this process has already imported it.  ``process`` is one of :data:`PROCESSES`.
    What cannot change in a process (the CPU, the versions) is read once; the rest (threads, the
    BLAS, oneDNN, variables) at each call — a few milliseconds, asked once per run, never per case.
    """
    loaded = [m for m in (FRAMEWORKS if frameworks is None else frameworks) if _module(m) is not None]
    torch = sys.modules["torch"] if "torch" in loaded else None
    tf = sys.modules["tensorflow"] if "tensorflow" in loaded else None
    env = os.environ
    blas = _numpy_blas()
    return {
        "process": process,
        **_static(),
        "cpu": {k: list(v) if isinstance(v, tuple) else v for k, v in _cpu()},
        "cpu_dispatch": {"numpy": _numpy_dispatch(), "torch": _call(torch, "backends.cpu.get_cpu_capability")},
        "onednn": {
            "TF_ENABLE_ONEDNN_OPTS": env.get("TF_ENABLE_ONEDNN_OPTS"),
            "tensorflow": _tf_onednn() if tf is not None else None,
            "torch": _torch_onednn(torch) if torch is not None else None,
        },
        "blas": None if blas is None else {**blas, "OPENBLAS_CORETYPE": env.get("OPENBLAS_CORETYPE")},
        "threads": {
            "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            **{v: env.get(v) for v in THREAD_VARIABLES},
            "blas": None if blas is None else blas.get("num_threads"),
            "torch": _call(torch, "get_num_threads"),
            "tensorflow_intra_op": _call(tf, "config.threading.get_intra_op_parallelism_threads"),
            "tensorflow_inter_op": _call(tf, "config.threading.get_inter_op_parallelism_threads"),
        },
        "frameworks": {"numpy": np.__version__, **dict(_version(m) for m in loaded)},
        "variables": {v: env[v] for v in KERNEL_VARIABLES if v in env},
    }


@functools.lru_cache(maxsize=1)
def _static() -> dict[str, Any]:
    from . import __version__
    from .spec.manifest import SPEC_VERSION

    return {
        "mhaspec_version": __version__,
        "spec_version": SPEC_VERSION,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "os": platform.platform(),
        "system": platform.system(),
        "machine": platform.machine(),
    }


def _module(name: str) -> Any:
    """The module if this process has imported it (never imports it)."""
    module = sys.modules.get(name)
    return module if module is not None and hasattr(module, "__version__") else None


@functools.lru_cache(maxsize=None)
def _version(module: str) -> tuple[str, str | None]:
    """(the distribution's name, the imported module's version)."""
    from importlib.metadata import PackageNotFoundError, version

    found = getattr(sys.modules.get(module), "__version__", None)
    for dist in FRAMEWORKS.get(module, (module,)):
        try:
            installed = version(dist)
        except PackageNotFoundError:
            continue
        return dist, str(found) if found is not None else installed
    return module, str(found) if found is not None else None


def _call(module: Any, path: str) -> Any:
    """``module.<path>()``, or None when the module is absent or the call fails."""
    if module is None:
        return None
    try:
        target = module
        for part in path.split("."):
            target = getattr(target, part)
        value = target()
    except Exception:  # noqa: BLE001 - a fact we cannot read is unknown, never an error of the run
        return None
    return value if isinstance(value, (bool, int, str)) else str(value)


def _torch_onednn(torch: Any) -> bool | None:
    """Whether torch may use its oneDNN (mkldnn) kernels: built with them and not switched off."""
    available = _call(torch, "backends.mkldnn.is_available")
    if available is None:
        return None
    return bool(available) and bool(getattr(getattr(torch.backends, "mkldnn", None), "enabled", True))


def _tf_onednn() -> bool | None:
    """Whether TensorFlow's oneDNN kernels are on in this process (TensorFlow already imported)."""
    port = sys.modules.get("tensorflow.python.util._pywrap_util_port")
    if port is None:
        try:
            from tensorflow.python.util import _pywrap_util_port as port  # tensorflow is imported: a submodule
        except Exception:  # noqa: BLE001
            return None
    try:
        return bool(port.IsMklEnabled())
    except Exception:  # noqa: BLE001
        return None


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[tuple[str, Any], ...]:
    """(model, vendor, flags) of this machine: /proc/cpuinfo, or ``platform`` without one (flags None)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def parse_cpuinfo(text: str) -> tuple[tuple[str, Any], ...]:
    """(model, vendor, flags) from the first processor of a /proc/cpuinfo text (x86 or arm64)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("cpu model") or fields.get("hardware")
    if not model and "cpu implementer" in fields:
        ids = (fields["cpu implementer"].lower(), fields.get("cpu part", "").lower())
        model = _ARM_PARTS.get(ids, f"implementer {ids[0]} part {ids[1]}")
    raw = fields.get("flags", fields.get("features"))
    flags = None if raw is None else tuple(f for f in KERNEL_FLAGS if f in set(raw.split()))
    return (("model", " ".join(model.split()) if model else (platform.processor() or None)),
            ("vendor", fields.get("vendor_id") or fields.get("cpu implementer")), ("flags", flags))


@functools.lru_cache(maxsize=1)
def _numpy_dispatch() -> str | None:
    """The highest SIMD target numpy's own kernels dispatch to here (e.g. ``X86_V3``, ``AVX512_SKX``)."""
    umath = sys.modules.get("numpy._core._multiarray_umath") or sys.modules.get("numpy.core._multiarray_umath")
    try:
        features, dispatch, baseline = umath.__cpu_features__, umath.__cpu_dispatch__, umath.__cpu_baseline__
    except AttributeError:
        return None
    usable = [t for t in dispatch if features.get(t)] or list(baseline)
    return usable[-1] if usable else None


def _numpy_blas() -> dict[str, Any] | None:
    """numpy's BLAS (threadpoolctl): internal_api, version, architecture (the core type), threading, threads."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    libraries = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    if not libraries:
        return None
    where = os.path.dirname(os.path.dirname(np.__file__))
    ours = [lib for lib in libraries if str(lib.get("filepath", "")).startswith(os.path.join(where, "numpy"))]
    lib = (ours or libraries)[0]
    return {key: lib.get(key) for key in ("internal_api", "version", "architecture", "threading_layer", "num_threads")}


# -- reading an environment back (reports, the matrix) -----------------------------------


def isa(env: Mapping[str, Any]) -> str:
    """The kernel-relevant instruction sets, short: ``avx2, no avx512``, ``avx512 vnni/bf16, amx bf16/int8``."""
    flags = (env.get("cpu") or {}).get("flags")
    if flags is None:
        return "flags unknown"
    have = set(flags)
    if "asimd" in have or "sve" in have:  # arm64
        arm = [f for f in ("sve2" if "sve2" in have else "sve", "sme", "bf16", "i8mm") if f in have]
        return ", ".join(arm) or "neon, no sve"
    if "avx512f" in have:
        parts = ["avx512 " + "/".join(x for x in ("vnni", "bf16", "fp16") if f"avx512_{x}" in have)]
    elif "avx2" in have:
        parts = ["avx2, no avx512"]
    else:
        parts = ["avx, no avx2" if "avx" in have else "no avx"]
    amx = [x for x in ("bf16", "int8", "fp16") if f"amx_{x}" in have]
    parts += [f"amx {'/'.join(amx)}"] if amx else []
    parts += [f for f in ("avx_vnni", "avx_ne_convert") if f in have]
    return ", ".join(p.strip() for p in parts)


def onednn_text(env: Mapping[str, Any]) -> str:
    """``oneDNN off`` (TensorFlow), ``torch oneDNN on``, ``TF_ENABLE_ONEDNN_OPTS=0``, or "" when nothing uses it."""
    onednn = env.get("onednn") or {}
    parts = []
    if onednn.get("tensorflow") is not None:
        parts.append(f"oneDNN {'on' if onednn['tensorflow'] else 'off'}")
    if onednn.get("torch") is not None:
        parts.append(f"torch oneDNN {'on' if onednn['torch'] else 'off'}")
    if onednn.get("TF_ENABLE_ONEDNN_OPTS") is not None:
        parts.append(f"TF_ENABLE_ONEDNN_OPTS={onednn['TF_ENABLE_ONEDNN_OPTS']}")
    return ", ".join(parts)


def blas_text(env: Mapping[str, Any]) -> str:
    """``OpenBLAS 0.3.31 Haswell, 2 threads`` (and ``OPENBLAS_CORETYPE=…`` when set)."""
    blas = env.get("blas")
    if not blas:
        return "BLAS unknown"
    name = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}.get(str(blas.get("internal_api")),
                                                                     str(blas.get("internal_api")))
    version = ".".join(str(blas.get("version") or "").split(".")[:3])
    text = " ".join(str(x) for x in (name, version, blas.get("architecture")) if x)
    if blas.get("num_threads") is not None:
        text += f", {blas['num_threads']} thread{'s' if blas['num_threads'] != 1 else ''}"
    if blas.get("OPENBLAS_CORETYPE"):
        text += f", OPENBLAS_CORETYPE={blas['OPENBLAS_CORETYPE']}"
    return text


def cpu_label(env: Mapping[str, Any] | None) -> str:
    """``AMD EPYC (avx2, no avx512)``; ``environment unknown`` for None."""
    if not env:
        return "environment unknown"
    return f"{(env.get('cpu') or {}).get('model') or 'unknown CPU'} ({isa(env)})"


def label(env: Mapping[str, Any] | None) -> str:
    """A short label: ``AMD EPYC (avx2, no avx512) · oneDNN off`` (``environment unknown`` for None)."""
    onednn = onednn_text(env) if env else ""
    return cpu_label(env) + (f" · {onednn}" if onednn else "")


def short_label(env: Mapping[str, Any] | None, width: int = 24) -> str:
    """A few words for a picture: ``AMD EPYC avx2``, ``Intel(R) Xeon(R) Platinum… avx512+amx · oneDNN on``."""
    if not env:
        return "environment unknown"
    model = str((env.get("cpu") or {}).get("model") or "unknown CPU")
    model = model if len(model) <= width else model[: width - 1] + "…"
    flags = set((env.get("cpu") or {}).get("flags") or ())
    level = isa(env).split(",")[0].split(" ")[0] + ("+amx" if any(f.startswith("amx_") for f in flags) else "")
    tf = (env.get("onednn") or {}).get("tensorflow")
    return f"{model} {level}" + ("" if tf is None else f" · oneDNN {'on' if tf else 'off'}")


def summary(env: Mapping[str, Any] | None, frameworks: bool = True) -> str:
    """One line: CPU and flags · oneDNN · BLAS · threads · frameworks · python · OS (the report's header).
    ``frameworks=False``: without what depends on the frameworks imported (oneDNN, their versions
    and threads): the machine that reports of several frameworks share."""
    if not env:
        return "environment unknown"
    threads = env.get("threads") or {}
    cpus = f"{threads.get('cpu_count')} CPUs"
    if threads.get("affinity") not in (None, threads.get("cpu_count")):
        cpus += f" ({threads['affinity']} usable)"
    cpus += "".join(f", {v}={threads[v]}" for v in THREAD_VARIABLES if threads.get(v) is not None)
    if frameworks and threads.get("torch") is not None:
        cpus += f", torch {threads['torch']} threads"
    parts = [label(env) if frameworks else cpu_label(env), blas_text(env), cpus]
    shown = {k: v for k, v in (env.get("frameworks") or {}).items() if k != "numpy"}
    if frameworks and shown:
        parts.append(", ".join(f"{k} {v}" for k, v in shown.items()))
    parts.append(f"python {env.get('python')} · {env.get('system')} {env.get('machine')}")
    program = env.get("program")
    if isinstance(program, Mapping) and program:
        facts = ", ".join(f"{k} {v}" for k, v in program.items() if k != "process" and isinstance(v, (str, int, float)))
        parts.append(f"program: {facts or 'no facts given'}")
    if env.get("process") == "runner":
        parts.append("(the runner's process: the adapter never ran)")
    return " · ".join(parts)


def kernel_facts(env: Mapping[str, Any]) -> dict[str, str | None]:
    """The facts that change kernels, as text (None: unknown) — what :func:`differences` compares.
    Not thread counts, versions of python or of the frameworks (a matrix has one row per framework),
    nor numpy's dispatch target, whose names change with numpy's version (the CPU flags decide it)."""
    cpu, blas = env.get("cpu") or {}, env.get("blas") or {}
    onednn = env.get("onednn") or {}
    core = blas.get("architecture") or blas.get("OPENBLAS_CORETYPE")
    flags = cpu.get("flags")

    def state(value: Any) -> str | None:
        return None if value is None else ("on" if value else "off")

    return {
        "machine": env.get("machine"),
        "CPU model": cpu.get("model"),
        "CPU kernel flags": None if flags is None else (" ".join(flags) or "none"),
        "BLAS core type": None if not blas else f"{blas.get('internal_api')} {core or '?'}",
        "oneDNN (tensorflow)": state(onednn.get("tensorflow")),
        "oneDNN (torch)": state(onednn.get("torch")),
        "torch dispatch": (env.get("cpu_dispatch") or {}).get("torch"),
    }


def differences(envs: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """What the environments of ``envs`` (name -> environment, None unknown) disagree on, one line a fact:
    ``CPU model: 'AMD EPYC' (a.json, b.json) vs 'Intel Xeon' (c.json)``.  A fact only one side knows
    (a report without TensorFlow has no TensorFlow oneDNN state) is no disagreement."""
    by_fact: dict[str, dict[str, list[str]]] = {}
    for name, env in envs.items():
        if not env:
            continue
        for fact, value in kernel_facts(env).items():
            if value is not None:
                by_fact.setdefault(fact, {}).setdefault(value, []).append(name)
    out = []
    for fact, values in by_fact.items():
        if len(values) < 2:
            continue
        if fact == "CPU kernel flags":  # the flags beyond those every report has
            sets = {value: set(value.split()) - {"none"} for value in values}
            common = set.intersection(*sets.values())
            shown = {" ".join(f for f in KERNEL_FLAGS if f in flags - common) or "none": names
                     for (_, names), flags in zip(values.items(), sets.values())}
            fact = f"CPU kernel flags beyond {' '.join(f for f in KERNEL_FLAGS if f in common) or 'none'}"
            values = shown
        out.append(f"{fact}: " + " vs ".join(f"{value!r} ({', '.join(names)})" for value, names in values.items()))
    return out


def where_lines(envs: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """Where a set of reports (name -> environment, None unknown) was run: a ``WARNING`` naming what
    their environments disagree on, or the machine they share; then the reports that record none."""
    known = [env for env in envs.values() if env]
    warnings = differences(envs)
    if warnings:
        lines = ["WARNING: these reports come from different environments (their kernels may differ): "
                 + "; ".join(warnings) + "."]
    elif known:
        lines = [f"Environment (every report that records one): {summary(known[0], frameworks=False)}."]
    else:
        lines = []
    unknown = [name for name, env in envs.items() if not env]
    if unknown:
        lines.append(f"Environment unknown (no `environment` in the report): {', '.join(unknown)}.")
    return lines
