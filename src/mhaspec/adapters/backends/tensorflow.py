"""The TensorFlow backend of the TensorFlow and Keras adapters: a quiet import, the backend
functions of :mod:`mhaspec.adapters.backends` (``dtype``, ``array_in``, ``array_out``,
``keep_mask``), and the run-time probe (:func:`probe`) from which they declare the deviations
that depend on the machine and on ``TF_ENABLE_ONEDNN_OPTS`` (docs/tensorflow.md, "Which
deviations apply here"); the texts of those deviations are data, in ``deviations/tensorflow.json``.

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

from ...protocol.contract import Deviation
from ...spec import Case, masks
from . import declared

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


#: The stages the ``tensorflow`` adapter computes by ``tf.einsum`` (forward) or its gradient (an einsum too).
EINSUM_STAGES = ("scores", "head_outputs", "d_attn_weights", "d_q_proj", "d_k_proj", "d_v_proj")

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


def einsum_error(name: str, einsum: Any = None) -> float:
    """How far a ``tf.einsum`` in the spec dtype ``name`` (float16 or bfloat16) of the ``tensorflow`` adapter's
    head-outputs product, over :data:`PROBE_TERMS` terms, is from the exact product, as a multiple of the error of
    rounding that product to the dtype once (root mean square over 16 × 8 outputs; fixed data: weights in
    [0, 1), normal values): 1.0 for a float32 accumulation rounded once, 10 to 20 for a sum in the dtype.
    ``einsum`` replaces ``tf.einsum`` (tests)."""
    rng = np.random.default_rng(0)
    np_dtype = dtype(name).as_numpy_dtype
    p = rng.random((1, 1, 16, PROBE_TERMS)).astype(np_dtype)
    v = rng.standard_normal((1, PROBE_TERMS, 1, 8)).astype(np_dtype)
    exact = np.einsum("BHTS,BSHE->BHTE", p.astype(np.float64), v.astype(np.float64))
    got = (einsum or tf.einsum)("BHTS,BSHE->BHTE", array_in(p, name), array_in(v, name))
    got = array_out(got).astype(np.float64)
    rounding = np.sqrt(np.mean((exact.astype(np_dtype).astype(np.float64) - exact) ** 2))
    return float(np.sqrt(np.mean((got - exact) ** 2)) / rounding)


def matmul_toward_zero(matmul: Any = None) -> float:
    """The share of a bfloat16 ``tf.linalg.matmul``'s inexact results (16 × 64 @ 64 × 8, fixed normal
    data) that lie between the exact product and zero: about 0.5 for round-to-nearest, 1.0 where the
    float32 result is truncated.  ``matmul`` replaces ``tf.linalg.matmul`` (tests)."""
    rng = np.random.default_rng(1)
    bf16 = dtype("bfloat16").as_numpy_dtype
    a = rng.standard_normal((16, 64)).astype(bf16)
    b = rng.standard_normal((64, 8)).astype(bf16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    got = array_out((matmul or tf.linalg.matmul)(array_in(a, "bfloat16"), array_in(b, "bfloat16")))
    got = got.astype(np.float64)
    inexact = got != exact
    toward_zero = np.abs(got) < np.abs(exact)
    return float(np.count_nonzero(toward_zero & inexact) / max(int(np.count_nonzero(inexact)), 1))


def softmax_tiny() -> float:
    """``tf.nn.softmax`` of the float32 logits [0, -87] at -87: exp(-87) = 1.65e-38 (a normal float32
    number below 2^-125), or 0 where the softmax flushes such probabilities."""
    logits = tf.constant([[0.0, _SOFTMAX_PROBE_LOGIT]], dtype=tf.float32)
    return float(array_out(tf.nn.softmax(logits, axis=-1))[0, 1])


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


def softmax_deviations(p: Probe) -> list[Deviation]:
    """oneDNN's float32 softmax flush, where ``p`` measures it: ``large_logits``'s attn_weights and d_scores."""
    return declared("tensorflow", "onednn-softmax", probe=p.softmax_text) if p.softmax_flushes else []


def einsum_deviations(p: Probe, stages: tuple[str, ...] = EINSUM_STAGES) -> list[Deviation]:
    """The ``tensorflow`` adapter's narrow accumulations as ``p`` measures them.

    Each dtype whose einsum sums in the dtype gets one declaration of the einsum ``stages``; float16's
    also covers the bias gradients (TensorFlow's float16 Sum accumulates in float16 on every CPU: both
    mechanisms, one declaration, as which of them exceeds the standard contract depends on the data).
    Where the float16 einsum keeps float32, only the Sum remains, declared where it exceeds the standard
    contract in the catalog (``key_padding``'s ``d_b_q``)."""
    out = []
    for name in ("float16", "bfloat16"):
        if p.einsum_narrow(name):
            out += declared("tensorflow", f"einsum-narrow-{name}", probe=p.einsum_text(name), stages="|".join(stages))
    if not p.einsum_narrow("float16"):
        out += declared("tensorflow", "reduce-sum-float16")
    return out


def matmul_deviations(p: Probe, stages: tuple[str, ...] = ("d_attn_weights",)) -> list[Deviation]:
    """bfloat16 matmul truncation, where ``p`` measures it, at ``stages`` (bounded by the worst-case contract)."""
    if not p.matmul_truncates:
        return []
    return declared("tensorflow", "matmul-truncates", probe=p.matmul_text, stages="|".join(stages))


def declared_at(key: str, stages: tuple[str, ...], **values: Any) -> list[Deviation]:
    """The declaration ``key`` of ``deviations/tensorflow.json``, once for each of ``stages`` (its ``{stage}``)."""
    return [d for stage in stages for d in declared("tensorflow", key, stage=stage, **values)]


def declared_where(key: str, where: tuple[tuple[str, str], ...]) -> list[Deviation]:
    """The declaration ``key`` of ``deviations/tensorflow.json`` at each (case, stage) of ``where``."""
    return [d for case, stage in where for d in declared("tensorflow", key, case=case, stage=stage)]


def dtype(name: str) -> Any:
    """The ``tf.DType`` for a spec dtype name (its ``as_numpy_dtype`` is NumPy's, bfloat16 ml_dtypes')."""
    return tf.as_dtype(name)


def array_in(x: np.ndarray, name: str) -> Any:
    """A float64 array as a tensor of the spec dtype ``name`` (exact for the catalog's data)."""
    return tf.constant(np.asarray(x).astype(dtype(name).as_numpy_dtype), dtype=dtype(name))


def array_out(t: Any) -> np.ndarray:
    """A tensor as a numpy array of its own dtype (bfloat16 stays ml_dtypes.bfloat16)."""
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def distinct_inputs(case: Case, query: Any, key: Any, value: Any) -> dict[str, Any]:
    """The distinct input tensors of ``case.inputs_as(...)`` by the name of their gradient: ``d_query``;
    ``d_key`` unless self-attention; ``d_value`` unless key and value are one tensor.  A tensor given
    as several inputs has one gradient, the sum of its shares (docs/backward.md)."""
    inputs = {"d_query": query}
    if not case.self_attention:
        inputs["d_key"] = key
        if not case.key_is_value:
            inputs["d_value"] = value
    return inputs


def keep_mask(case: Case, *, causal: bool = False, window: bool = False, heads: bool = True) -> Any:
    """The case's mask as a bool tensor (True = may attend: TensorFlow's and Keras's polarity, the
    spec's), broadcast to (B, H_mask, T, S), H_mask in {1, H}, or (B, T, S) without ``heads`` (one
    mask for every head); ANDed with the case's causal band when ``causal`` and with its sliding
    window's band when ``window``.  None where nothing is hidden."""
    mask = case.inputs.mask
    bands = [band for band in (masks.causal_visible(case.config, case.T, case.S) if causal else None,
                               masks.window_visible(case.config, case.T, case.S) if window else None)
             if band is not None]
    if mask is None and not bands:
        return None
    shown = mask.shape[-3] if mask is not None and mask.ndim >= 3 else 1
    keep = np.broadcast_to(True if mask is None else mask, (case.B, shown, case.T, case.S))
    for band in bands:
        keep = keep & band
    return tf.constant(keep if heads else keep[:, 0])
