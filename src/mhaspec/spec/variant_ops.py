"""The attention variants' operations in plain float64 numpy (docs/spec.md §2a), for the judge's own
float64 recomputations (the fast reference, the tolerance model, the local checks): what each variant
does to which rows, once.

Not the exact reference (:mod:`mhaspec.reference.variants` rounds every value once, correctly): here
``cos``, ``sin`` and ``tanh`` are numpy's and each value may be a few float64 ulps off.  A caller that
needs a bound of that adds it.

Every function takes the rows it is asked for by their offset in the whole case (``row_offset``:
query row 0 of the array is row ``row_offset`` of the case) and the whole case's lengths where the
alignment needs them (``tgt_len``: T of the whole case), so a block of query rows gets the same values
as the whole case.  Axis legend: B, T, S, H, H_kv, D_k (:mod:`mhaspec.spec.config`); r = rotary_dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .masks import alignment_offset
from .variants import alibi_slope_values

if TYPE_CHECKING:
    from .config import MHAConfig
    from .variants import RopeSpec


def rope_positions(config: MHAConfig, rows: int, src_len: int, row_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(query positions (rows,), key positions (S,)), int64: query_offset + row_offset + i and
    key_offset + j (docs/spec.md "RoPE")."""
    spec = config.rope
    assert spec is not None, "rope_positions needs config.rope"
    return (spec.query_offset + row_offset + np.arange(rows, dtype=np.int64),
            spec.key_offset + np.arange(src_len, dtype=np.int64))


def rope_pairs(spec: RopeSpec, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, second) (r/2,) feature indices of the pairs that turn together: (k, k + r/2) in style
    "half", (2k, 2k + 1) in style "interleaved"."""
    half = rotary_dim // 2
    if spec.style == "half":
        return np.arange(half), np.arange(half) + half
    return 2 * np.arange(half), 2 * np.arange(half) + 1


def rope_angles(spec: RopeSpec, rotary_dim: int, positions: np.ndarray) -> np.ndarray:
    """(L, r/2) float64: the angle position · theta^(−2k/r) of pair k (−2k/r, the power and the product
    each rounded once)."""
    k = np.arange(rotary_dim // 2, dtype=np.float64)
    inv_freq = float(spec.theta) ** (-2.0 * k / rotary_dim)  # (r/2,)
    return positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (L, r/2)


def rope_cos_sin(spec: RopeSpec, rotary_dim: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), each (L, r/2) float64: of the angle position · theta^(−2k/r) of pair k."""
    angle = rope_angles(spec, rotary_dim, positions)
    return np.cos(angle), np.sin(angle)


def rope(x: np.ndarray, heads: int, positions: np.ndarray, config: MHAConfig) -> np.ndarray:
    """x (B, L, heads·D) turned by RoPE at ``positions`` (L,): in each head, pair (a, b) becomes
    (a·cos − b·sin, b·cos + a·sin); features past rotary_dim pass through.  -> (B, L, heads·D)."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None, "rope needs config.rope (resolved)"
    B, L, F = x.shape
    first, second = rope_pairs(spec, spec.rotary_dim)
    cos, sin = rope_cos_sin(spec, spec.rotary_dim, positions)  # (L, r/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, L, 1, r/2)
    h = np.asarray(x, dtype=np.float64).reshape(B, L, heads, F // heads)
    out = h.copy()
    a, b = h[..., first], h[..., second]
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out.reshape(B, L, F)


def softcap(s: np.ndarray, cap: float) -> np.ndarray:
    """cap · tanh(s / cap), element-wise."""
    return cap * np.tanh(np.asarray(s, dtype=np.float64) / cap)


def alibi_distance(config: MHAConfig, rows: int, src_len: int, tgt_len: int, row_offset: int = 0) -> np.ndarray:
    """(rows, S) int64: |i + off − j| for case rows i = row_offset … row_offset + rows − 1, with
    off = 0 top-left, S − T bottom-right (the whole case's T: ``tgt_len``)."""
    i = row_offset + np.arange(rows, dtype=np.int64)[:, None] + alignment_offset(config, tgt_len, src_len)
    return np.abs(i - np.arange(src_len, dtype=np.int64)[None, :])


def alibi(config: MHAConfig, rows: int, src_len: int, tgt_len: int, row_offset: int = 0) -> np.ndarray | None:
    """(H, rows, S) float64: −slope_h · |i + off − j|, the ALiBi term added to the scores; None without ALiBi."""
    slopes = alibi_slope_values(config)
    if slopes is None:
        return None
    return -slopes[:, None, None] * alibi_distance(config, rows, src_len, tgt_len, row_offset)[None].astype(np.float64)
