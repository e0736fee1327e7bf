"""Deterministic inputs and weights that are exact in every dtype under test.

Every value is ``k · 2^-e`` with an integer ``|k| <= 64`` (seven significant
bits), so it is exactly representable in bfloat16 (8 significant bits),
float16 (11), float32 and float64, as long as ``2^-e`` stays within float16's
range — which the case catalog's exponents do.  The float64 golden is then the
exact answer for the very same inputs in every dtype.

The integers ``k`` come from SHAKE-256 of ``"<seed>/<tensor name>"``, not from
numpy's ``Generator``: its distribution streams are not promised to stay the
same across numpy versions, and a hash is the same on every machine forever.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

#: Largest |k| in ``k · 2^-e``: 64 needs 7 significant bits.
K_MAX = 64


def hash_integers(key: str, count: int, modulus: int) -> np.ndarray:
    """``count`` integers in ``[0, modulus)`` derived from SHAKE-256 of ``key``."""
    raw = hashlib.shake_256(key.encode("utf-8")).digest(4 * count)
    words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    return words % modulus


def dyadic_tensor(key: str, shape: tuple[int, ...], exponent: int) -> np.ndarray:
    """float64 array of ``shape`` with values ``k · 2^-exponent``, ``k`` in [-64, 64]."""
    count = math.prod(shape)
    k = hash_integers(key, count, 2 * K_MAX + 1) - K_MAX
    return np.ldexp(k.astype(np.float64), -exponent).reshape(shape)


def weight_exponent(fan_in: int, shift: int = 0) -> int:
    """Exponent giving weights of magnitude about ``1/sqrt(fan_in)``.

    ``k / 2^5`` spans [-2, 2]; dividing further by ``2^round(log2(fan_in)/2)``
    keeps projections and scores O(1), like a standard initialisation, with a power of two
    so the values stay exact.
    """
    return 5 + round(math.log2(fan_in) / 2) - shift


def random_bits(key: str, shape: tuple[int, ...], density: float) -> np.ndarray:
    """Boolean array, True with probability ~``density``, from SHAKE-256 of ``key``."""
    count = math.prod(shape)
    ints = hash_integers(key, count, 1 << 16)
    return (ints < round(density * (1 << 16))).reshape(shape)
