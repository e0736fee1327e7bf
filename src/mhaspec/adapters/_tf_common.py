"""What the TensorFlow and Keras adapters share: a quiet import, dtypes,
numpy <-> tensor conversion, and the run-time probe (:func:`probe`) from which
they declare the deviations that depend on the machine and on
``TF_ENABLE_ONEDNN_OPTS`` (docs/tensorflow.md, "Which deviations apply here").

TensorFlow 2.21 logs through absl before ``absl::InitializeLog()`` runs, so
``TF_CPP_MIN_LOG_LEVEL`` does not silence its import-time lines (oneDNN,
CPU features).  :func:`quiet_import` therefore also points the process's
native stderr (file descriptor 2) at ``/dev/null`` while the import runs, and
only then; Python errors raised by the import still propagate.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


#: A deviation of TensorFlow's CPU softmax, declared by every adapter that exposes attn_weights, where the
#: probe measures it (:attr:`Probe.softmax_flushes`).
ONEDNN_SOFTMAX = (
    "TensorFlow's oneDNN CPU softmax (TF_ENABLE_ONEDNN_OPTS=1) returns 0 for probabilities below 2^-125 (here "
    "2.15e-38 expected); Eigen's softmax (TF_ENABLE_ONEDNN_OPTS=0) returns them"
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

#: TensorFlow's CPU Einsum of float16 or bfloat16 where the probe measures a sum in the dtype itself.
EINSUM_NARROW = (
    "TensorFlow's CPU Einsum of {dtype} accumulates in {dtype} in this process (the scores, the head outputs and "
    "their gradients; {probe}): where oneDNN does not take {dtype} (it is off, or the CPU lacks {needs}: "
    "IsDataTypeSupportedByOneDNNOnThisCPU, tensorflow/core/util/util.cc), Einsum hands the product to Eigen's "
    "{dtype} contraction (LaunchBatchMatMul<CPUDevice, {dtype}>), which sums in {dtype}, in blocks whose sizes "
    "depend on the shapes and the CPU's caches, so which catalog stages exceed the standard contract depends on "
    "the machine (tf.linalg.matmul computes in float32: BaseBatchMatMulOp), outside the standard contract's "
    "float32 accumulation; within --precision worst-case"
)
#: What oneDNN needs to take each narrow dtype (util.cc).
_ONEDNN_NEEDS = {"float16": "AVX512BW with AVX512-FP16 or AMX-FP16, or AVX-NE-CONVERT",
                 "bfloat16": "AVX512F or AVX-NE-CONVERT"}

#: TensorFlow's bfloat16 matmul where the probe measures a result truncated to bfloat16.
MATMUL_TRUNCATES = (
    "TensorFlow's CPU MatMul/BatchMatMul of bfloat16 rounds its float32 result toward zero in this process "
    "({probe}): where oneDNN does not take bfloat16 (it is off, or the CPU lacks AVX512F and AVX-NE-CONVERT), "
    "BaseBatchMatMulOp (tensorflow/core/kernels/matmul_op_impl.h) computes in float32 and converts back with "
    "FloatToBFloat16, which keeps the upper 16 bits (tensorflow/core/framework/bfloat16.cc): a bias of half a "
    "bfloat16 ulp toward zero on every product Keras computes with tf.matmul (its attention einsums, "
    "keras/src/backend/tensorflow/numpy.py use_custom_ops), beyond the standard contract where the sums are "
    "short (d_attn_weights, over D_v terms); within --precision worst-case"
)


#: Limits of :class:`Probe`: an einsum with more than this multiple of a float32 accumulation's error sums in
#: the dtype (a float32 accumulation rounded once measures 1.0, rounded toward zero about 2, a sum in the dtype
#: over the probe's 512 terms 10 to 20); a matmul with more than this share of its inexact results rounded
#: toward zero truncates (round-to-nearest gives about half).
NARROW_ACCUMULATION_LIMIT = 4.0
TRUNCATION_LIMIT = 0.9
#: The probe's softmax logit: exp(-87) = 1.65e-38 is a normal float32 number below 2^-125.
_SOFTMAX_PROBE_LOGIT = -87.0
#: The length of the probe's einsum sums.
PROBE_TERMS = 512


def einsum_error(dtype: str, einsum: Any = None) -> float:
    """How far a ``dtype`` (float16 or bfloat16) ``tf.einsum`` of the ``tensorflow`` adapter's head-outputs
    product, over :data:`PROBE_TERMS` terms, is from the exact product, as a multiple of the error of
    rounding that product to the dtype once (root mean square over 16 × 8 outputs; fixed data: weights in
    [0, 1), normal values): 1.0 for a float32 accumulation rounded once, 10 to 20 for a sum in the dtype.
    ``einsum`` replaces ``tf.einsum`` (tests)."""
    rng = np.random.default_rng(0)
    np_dtype = numpy_dtype(dtype)
    p = rng.random((1, 1, 16, PROBE_TERMS)).astype(np_dtype)
    v = rng.standard_normal((1, PROBE_TERMS, 1, 8)).astype(np_dtype)
    exact = np.einsum("BHTS,BSHE->BHTE", p.astype(np.float64), v.astype(np.float64))
    got = (einsum or tf.einsum)("BHTS,BSHE->BHTE", to_tensor(p, dtype), to_tensor(v, dtype))
    got = to_numpy(got).astype(np.float64)
    rounding = np.sqrt(np.mean((exact.astype(np_dtype).astype(np.float64) - exact) ** 2))
    return float(np.sqrt(np.mean((got - exact) ** 2)) / rounding)


def matmul_toward_zero(matmul: Any = None) -> float:
    """The share of a bfloat16 ``tf.linalg.matmul``'s inexact results (16 × 64 @ 64 × 8, fixed normal
    data) that lie between the exact product and zero: about 0.5 for round-to-nearest, 1.0 where the
    float32 result is truncated.  ``matmul`` replaces ``tf.linalg.matmul`` (tests)."""
    rng = np.random.default_rng(1)
    bf16 = numpy_dtype("bfloat16")
    a = rng.standard_normal((16, 64)).astype(bf16)
    b = rng.standard_normal((64, 8)).astype(bf16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = to_numpy((matmul or tf.linalg.matmul)(to_tensor(a, "bfloat16"), to_tensor(b, "bfloat16")))
    got = got.astype(np.float64)
    inexact = got != exact
    toward_zero = np.abs(got) < np.abs(exact)
    return float(np.count_nonzero(toward_zero & inexact) / max(int(np.count_nonzero(inexact)), 1))


def softmax_tiny() -> float:
    """``tf.nn.softmax`` of the float32 logits [0, -87] at -87: exp(-87) = 1.65e-38 (a normal float32
    number below 2^-125), or 0 where the softmax flushes such probabilities."""
    logits = tf.constant([[0.0, _SOFTMAX_PROBE_LOGIT]], dtype=tf.float32)
    return float(to_numpy(tf.nn.softmax(logits, axis=-1))[0, 1])


@dataclass(frozen=True)
class Probe:
    """What this process's TensorFlow computes on the CPU, measured by running three tiny ops (:func:`probe`).

    The TensorFlow adapters declare the machine-dependent deviations from it: whether oneDNN or Eigen
    runs an op, and how Eigen blocks a contraction, depend on ``TF_ENABLE_ONEDNN_OPTS``, the CPU's features
    and its caches, none of which a rule about the CPU can predict as surely as the op itself.
    """

    #: ``softmax_tiny()``: 0 where the softmax flushes probabilities below 2^-125.
    softmax_tiny: float
    #: ``{"float16": einsum_error("float16"), "bfloat16": einsum_error("bfloat16")}``.
    einsum_error: Mapping[str, float]
    #: ``matmul_toward_zero()``.
    matmul_toward_zero: float

    @property
    def softmax_flushes(self) -> bool:
        return self.softmax_tiny == 0.0

    def einsum_narrow(self, dtype: str) -> bool:
        """Whether the ``dtype`` einsum sums in ``dtype`` (its error above :data:`NARROW_ACCUMULATION_LIMIT`)."""
        return self.einsum_error[dtype] > NARROW_ACCUMULATION_LIMIT

    @property
    def matmul_truncates(self) -> bool:
        return self.matmul_toward_zero > TRUNCATION_LIMIT

    def einsum_text(self, dtype: str) -> str:
        return (f"probe: a {dtype} tf.einsum over {PROBE_TERMS} terms has {self.einsum_error[dtype]:.1f}x the "
                f"error of a float32 accumulation rounded once, above {NARROW_ACCUMULATION_LIMIT:g}x")

    @property
    def matmul_text(self) -> str:
        return (f"probe: {self.matmul_toward_zero:.0%} of a bfloat16 tf.linalg.matmul's inexact results are "
                "rounded toward zero, where round-to-nearest gives about half")

    @property
    def softmax_text(self) -> str:
        return (f"probe: tf.nn.softmax of the float32 logits [0, {_SOFTMAX_PROBE_LOGIT:g}] gives "
                f"{self.softmax_tiny:.3g} for exp({_SOFTMAX_PROBE_LOGIT:g}) = 1.65e-38")


@functools.lru_cache(maxsize=None)
def probe() -> Probe:
    """This process's :class:`Probe`, measured at the first call and kept.

    It runs TensorFlow ops, so it is called only where the adapter computes: the adapters read it in
    ``known_deviations``, which the worker process reads after loading the adapter (a forked worker of a
    process whose TensorFlow thread pools have started may hang: docs/contract-notes.md)."""
    return Probe(softmax_tiny=softmax_tiny(),
                 einsum_error={d: einsum_error(d) for d in ("float16", "bfloat16")},
                 matmul_toward_zero=matmul_toward_zero())


def softmax_deviations(p: Probe, case: str = "large_logits") -> list[Any]:
    """oneDNN's float32 softmax flush, where ``p`` measures it: ``case``'s attn_weights and d_scores."""
    from .base import Deviation

    if not p.softmax_flushes:
        return []
    reason = f"{ONEDNN_SOFTMAX} ({p.softmax_text})"
    return [Deviation(reason, case=case, dtype="float32", stage="attn_weights"),
            Deviation(reason + BACKWARD_ONEDNN_SOFTMAX, case=case, dtype="float32", stage="d_scores")]


def einsum_deviations(p: Probe, stages: tuple[str, ...] = EINSUM_STAGES) -> list[Any]:
    """The ``tensorflow`` adapter's narrow accumulations as ``p`` measures them.

    Each dtype whose einsum sums in the dtype gets one declaration of the einsum ``stages``; float16's
    also covers the bias gradients (TensorFlow's float16 Sum accumulates in float16 on every CPU: both
    mechanisms, one declaration, as which of them exceeds the standard contract depends on the data).
    Where the float16 einsum keeps float32, only the Sum remains, declared where it exceeds the standard
    contract in the catalog (``key_padding``'s ``d_b_q``)."""
    from .base import Deviation

    out = []
    for dtype in ("float16", "bfloat16"):
        if not p.einsum_narrow(dtype):
            continue
        reason = EINSUM_NARROW.format(dtype=dtype, probe=p.einsum_text(dtype), needs=_ONEDNN_NEEDS[dtype])
        covered = stages
        if dtype == "float16":
            reason += ". Also backward: the bias gradients are tf.reduce_sum over batch and length, and " + _SUM_FLOAT16
            covered = (*stages, "d_b_q", "d_b_k", "d_b_v")
        out.append(Deviation(reason, dtype=dtype, stage="|".join(covered), within="worst-case"))
    if not p.einsum_narrow("float16"):
        out.append(Deviation(REDUCE_SUM_FLOAT16, case="key_padding", dtype="float16", stage="d_b_q",
                             within="worst-case"))
    return out


def matmul_deviations(p: Probe, stages: tuple[str, ...] = ("d_attn_weights",)) -> list[Any]:
    """bfloat16 matmul truncation, where ``p`` measures it, at ``stages`` (bounded by the worst-case contract)."""
    from .base import Deviation

    if not p.matmul_truncates:
        return []
    return [Deviation(MATMUL_TRUNCATES.format(probe=p.matmul_text), dtype="bfloat16", stage="|".join(stages),
                      within="worst-case")]


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
