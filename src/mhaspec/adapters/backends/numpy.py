"""NumPy as a backend: dtypes, arrays in, the visibility mask, canonical weights.

The ``numpy`` adapter computes with these arrays, and the ONNX adapters feed them to their
graphs (an ONNX tensor is a NumPy array in the graph's element type).  bfloat16 is
``ml_dtypes.bfloat16``, imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ...spec import DTYPES, Case, Weights, masks


def dtype(name: str) -> np.dtype:
    """The NumPy dtype for a spec dtype name (bfloat16 is ``ml_dtypes.bfloat16``)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return np.dtype(name)


def array_in(x: Any, dtype: str) -> np.ndarray:
    """A float64 case array in the spec dtype ``dtype``, C-contiguous (exact: case data is
    representable in every dtype)."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64).astype(_dtype(dtype)))


_dtype = dtype  # for array_in, whose argument is named dtype


def keep_mask(case: Case) -> np.ndarray:
    """(B, H, T, S) bool, True = may attend: the case's causal rule AND its explicit mask."""
    return masks.visibility(case.config, case.inputs.mask, case.batch, case.tgt_len, case.src_len)


def weights_in(weights: Weights | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Canonical weights as a ``{name: float64 array}`` dict (absent biases left out), the
    layout every backend's converter starts from."""
    items = weights.as_dict() if isinstance(weights, Weights) else dict(weights)
    return {k: np.asarray(v, dtype=np.float64) for k, v in items.items() if v is not None}


def sum_to_shape(grad: Any, shape: tuple[int, ...]) -> Any:
    """grad (a NumPy array, or any tensor with ``sum(axis=, keepdims=)``: torch's) summed over the axes
    where ``shape`` (as long as grad's) has 1 and grad does not: the gradient of an input that was
    broadcast to grad's shape (the bias (B|1, H|1, T, S) in the (B, H, T, S) scores)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(grad.shape, shape)) if m == 1 and n != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad
