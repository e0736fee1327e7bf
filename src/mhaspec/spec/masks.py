"""Which keys each query row sees: the one visibility rule (docs/spec.md "Masking").

A query row i sees key j when every rule of the case allows it (they combine by AND):

* **causal**, aligned top-left (j ≤ i) or bottom-right (j ≤ i + S − T): the diagonal moves
  right by :func:`causal_offset`;
* a **sliding window** (``window_left``, ``window_right``; FlashAttention's rule):
  i + off − window_left ≤ j ≤ i + off + window_right, with off = :func:`alignment_offset`
  (0 top-left, S − T bottom-right: the case's ``causal_alignment``, causal or not); a side that is
  None is unbounded;
* the explicit **mask** (True = may attend), broadcast to (B, H, T, S);
* a packed case's **sequence lengths** ``seq_lens``: key j ≥ l_b is padding, invisible to every row of
  entry b (:mod:`mhaspec.spec.packed`).

The reference, the tolerance model and the adapters all take it from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .packed import key_visible

if TYPE_CHECKING:
    from .config import MHAConfig


def causal_offset(config: MHAConfig, tgt_len: int, src_len: int) -> int | None:
    """How far right the causal diagonal moves: 0 top-left, S − T bottom-right; None when not causal."""
    return alignment_offset(config, tgt_len, src_len) if config.causal else None


def alignment_offset(config: MHAConfig, tgt_len: int, src_len: int) -> int:
    """Where query row i's diagonal is: key i + off, off = 0 top-left, S − T bottom-right (the case's
    ``causal_alignment``, which places windows and ALiBi also in a case that is not causal)."""
    return 0 if config.causal_alignment == "top_left" else src_len - tgt_len


def window_visible(config: MHAConfig, tgt_len: int, src_len: int) -> np.ndarray | None:
    """(T, S) bool of the case's sliding window, or None without one:
    i + off − window_left ≤ j ≤ i + off + window_right (an unset side is unbounded)."""
    left, right = config.window_left, config.window_right
    if left is None and right is None:
        return None
    distance = np.arange(src_len)[None, :] - (np.arange(tgt_len)[:, None] + alignment_offset(config, tgt_len, src_len))
    visible = np.ones((tgt_len, src_len), dtype=bool)
    if left is not None:
        visible &= distance >= -left
    if right is not None:
        visible &= distance <= right
    return visible


def causal_band(tgt_len: int, src_len: int, offset: int) -> np.ndarray:
    """(T, S) bool: key j visible to query i when j ≤ i + ``offset``."""
    return np.arange(src_len)[None, :] <= np.arange(tgt_len)[:, None] + offset


def causal_visible(config: MHAConfig, tgt_len: int, src_len: int) -> np.ndarray | None:
    """(T, S) bool of the case's causal rule, or None when it is not causal."""
    offset = causal_offset(config, tgt_len, src_len)
    return None if offset is None else causal_band(tgt_len, src_len, offset)


def visibility(config: MHAConfig, mask: np.ndarray | None, batch: int, tgt_len: int, src_len: int,
               seq_lens: Sequence[int] | None = None, heads: int | None = None) -> np.ndarray:
    """(B, H, T, S) bool: True where query i may attend to key j (causal AND window AND mask AND, in a packed
    case, j < l_b); ``heads=1``: (B, 1, T, S), for a mask (if any) the same in every head."""
    visible = np.ones((batch, config.H if heads is None else heads, tgt_len, src_len), dtype=bool)
    for band in (causal_visible(config, tgt_len, src_len), window_visible(config, tgt_len, src_len)):
        if band is not None:
            visible &= band
    if mask is not None:
        visible &= np.broadcast_to(mask, visible.shape)
    if seq_lens is not None:
        visible &= key_visible(seq_lens, src_len)
    return visible


def seen_keys(visible: np.ndarray) -> int:
    """1 + the last key that some query row of ``visible`` (…, T, S) sees; S where none sees any.  Rows
    of a causal (or windowed) case see none beyond: their weights there are 0 and their scores not
    compared, so a softmax, a product P·V and the judge's sums over the keys of those rows may stop there."""
    seen = np.flatnonzero(visible.reshape(-1, visible.shape[-1]).any(axis=0))
    return int(seen[-1]) + 1 if seen.size else visible.shape[-1]
