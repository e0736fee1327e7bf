"""What the TensorFlow and Keras adapters share: a quiet import, dtypes, and
numpy <-> tensor conversion.

TensorFlow 2.21 logs through absl before ``absl::InitializeLog()`` runs, so
``TF_CPP_MIN_LOG_LEVEL`` does not silence its import-time lines (oneDNN,
CPU features).  :func:`quiet_import` therefore also points the process's
native stderr (file descriptor 2) at ``/dev/null`` while the import runs, and
only then; Python errors raised by the import still propagate.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Discard what native code writes to file descriptor 2 inside the block."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no usable fd 2: nothing to silence
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def quiet_import(name: str) -> ModuleType:
    """``importlib.import_module(name)`` without TensorFlow's native log lines."""
    if name in sys.modules:
        return sys.modules[name]
    with _native_stderr_silenced():
        return importlib.import_module(name)


tf = quiet_import("tensorflow")


def _distribution(module: str) -> str:
    """The installed distribution that provides ``module`` (tensorflow, tensorflow-cpu, …),
    so the report can show its version."""
    from importlib.metadata import packages_distributions

    return (packages_distributions().get(module) or [module])[0]


TF_DISTRIBUTION = _distribution("tensorflow")


#: A deviation of TensorFlow's CPU softmax, declared by every adapter that exposes attn_weights.
ONEDNN_SOFTMAX = (
    "TensorFlow's oneDNN CPU softmax (TF_ENABLE_ONEDNN_OPTS=1, the default on x86) returns 0 for "
    "probabilities below 2^-125 (here 2.15e-38 expected); Eigen's softmax (TF_ENABLE_ONEDNN_OPTS=0) returns them"
)

#: The same, carried into the backward: d_scores = P ⊙ (dP − δ) is 0 where P was flushed to 0.
BACKWARD_ONEDNN_SOFTMAX = "; backward: d_scores = P ⊙ (d_attn_weights − δ) is 0 wherever P was flushed to 0"

#: TensorFlow's CPU reductions of float16 accumulate in float16 (bfloat16 gets a float32 accumulator).
_SUM_FLOAT16 = (
    "TensorFlow's CPU Sum of float16 accumulates in float16 (reduction_ops.h gives only bfloat16 a float "
    "accumulator: tensorflow/tensorflow#123299, fix proposed in #124049), outside the standard contract's "
    "float32 accumulation; within --precision worst-case"
)
#: The Sum in key_padding's d_b_q, where it exceeds the standard contract in the catalog.
REDUCE_SUM_FLOAT16 = (
    "backward: a bias gradient is tf.reduce_sum of the upstream gradient over batch and length (here 21 rows), and "
    + _SUM_FLOAT16
)


#: The stages the ``tensorflow`` adapter computes by ``tf.einsum`` (forward) or its gradient (an einsum too).
EINSUM_STAGES = ("scores", "head_outputs", "d_attn_weights", "d_q_proj", "d_k_proj", "d_v_proj")

#: TensorFlow's CPU Einsum of float16 where oneDNN does not take float16, declared with the Sum of
#: every case's bias gradients in one declaration.
EINSUM_FLOAT16 = (
    "TensorFlow's CPU Einsum of float16 accumulates in float16 here (the scores, the head outputs and their "
    "gradients): oneDNN does not take float16 ({why}; tensorflow/core/util/util.cc), and Eigen's Einsum kernel, "
    "which runs instead, sums in float16 (measured on an AMD EPYC: 15x the error of a float32 accumulation over "
    "512 terms; tf.linalg.matmul keeps float32), outside the standard contract's float32 accumulation; within "
    "--precision worst-case. Also backward: the bias gradients are tf.reduce_sum over batch and length, and "
    + _SUM_FLOAT16
)

#: CPU flags (``/proc/cpuinfo``) with which TensorFlow lets oneDNN take float16: AVX512BW with one of
#: the first set, or the second alone (``IsDataTypeSupportedByOneDNNOnThisCPU`` in util.cc).
ONEDNN_FLOAT16_FLAGS = ({"avx512_fp16", "amx_fp16"}, {"avx_ne_convert"})


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def onednn_float16_missing() -> str | None:
    """Why oneDNN does not take this TensorFlow's float16 ops, or None where it does.

    TensorFlow's own rule, read without running an op (a forked worker of a process whose
    thread pools have started may hang: docs/contract-notes.md): oneDNN must be on
    (``TF_ENABLE_ONEDNN_OPTS``, the default on x86) and the CPU must have AVX512BW with
    AVX512-FP16 or AMX-FP16, or AVX-NE-CONVERT.  tests/frameworks/test_backward_tensorflow.py
    measures a float16 ``tf.einsum`` on the machine it runs on (ops may run there): a float32
    accumulation where oneDNN takes float16, as the rule implies."""
    from tensorflow.python.util import _pywrap_util_port

    if not _pywrap_util_port.IsMklEnabled():
        return "oneDNN is off (TF_ENABLE_ONEDNN_OPTS=0, or a build without it)"
    flags = _cpu_flags()
    pair, alone = ONEDNN_FLOAT16_FLAGS
    if ("avx512bw" in flags and flags & pair) or flags & alone:
        return None
    return "the CPU has neither AVX512BW with AVX512-FP16 or AMX-FP16, nor AVX-NE-CONVERT"


def float16_sum_deviations() -> list[Any]:
    """The ``tensorflow`` adapter's float16 accumulation deviations on this machine.

    Where oneDNN does not take float16 (:func:`onednn_float16_missing`), Eigen's Einsum
    accumulates in float16 too: one declaration covers the einsum stages and the bias
    gradients (both mechanisms, one reason, every case), as which of them exceeds the
    standard contract in a given case depends on the data.  Elsewhere only the Sum remains,
    declared where it exceeds it in the catalog (``key_padding``)."""
    from .base import Deviation

    why = onednn_float16_missing()
    if why is not None:
        return [Deviation(EINSUM_FLOAT16.format(why=why), dtype="float16",
                          stage="|".join((*EINSUM_STAGES, "d_b_q", "d_b_k", "d_b_v")), within="worst-case")]
    return [Deviation(REDUCE_SUM_FLOAT16, case="key_padding", dtype="float16", stage="d_b_q", within="worst-case")]


def numpy_dtype(name: str) -> Any:
    """The numpy dtype for a spec dtype name (bfloat16 through ml_dtypes, as TensorFlow uses)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def to_tensor(x: np.ndarray, dtype: str) -> Any:
    """A float64 array as a tensor of the spec dtype ``dtype`` (exact for the catalog's data)."""
    return tf.constant(np.asarray(x).astype(numpy_dtype(dtype)), dtype=tf.as_dtype(dtype))


def to_numpy(t: Any) -> np.ndarray:
    """A tensor as a numpy array of its own dtype (bfloat16 stays ml_dtypes.bfloat16)."""
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def attend_mask(mask: np.ndarray | None, B: int, T: int, S: int) -> np.ndarray | None:
    """The spec's mask (True = may attend, broadcastable to (B, H, T, S)) broadcast to
    (B, H_mask, T, S), H_mask in {1, H}.  TensorFlow and Keras use the same polarity
    (1/True = attend), so no inversion is needed."""
    if mask is None:
        return None
    heads = mask.shape[-3] if mask.ndim >= 3 else 1
    return np.broadcast_to(mask, (B, heads, T, S))
