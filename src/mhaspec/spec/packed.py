"""A packed case: ``seq_lens`` — batch entry b is one sequence of l_b tokens (docs/serving.md "Packed
sequences").

Entry b's query rows and keys [0, l_b) are its sequence; rows and keys ≥ l_b are padding, invisible to
every row of the entry (:func:`mhaspec.spec.masks.visibility`), so the golden's rows i < l_b are exactly
the sequence's own full pass.  The adapter receives the canonical padded layout (B, T, ·) with every
padding row of query, key and value filled with NaN (:func:`nan_padded`): a kernel that reads padding
leaks NaN.  A packed kernel concatenates the valid rows into one (1, Σ l_b) call delimited by
``cu_seqlens`` (:func:`cu_seqlens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .schedule import Call


def seq_lens_problem(seq_lens: Sequence[int], batch: int, tgt_len: int, src_len: int,
                     schedule: Sequence[int] | None) -> str | None:
    """Why ``seq_lens`` is not valid for a case (one line naming ``seq_lens``), or None."""
    if len(seq_lens) != batch:
        return f"seq_lens: need one length per batch entry (B = {batch}), got {len(seq_lens)}: {tuple(seq_lens)}"
    if tgt_len != src_len:
        return (f"seq_lens: a packed case is self-attention lengths (each sequence's queries are its keys): "
                f"needs T == S, got T = tgt_len = {tgt_len}, S = src_len = {src_len}")
    bad = [f"seq_lens[{b}] = {n}" for b, n in enumerate(seq_lens) if not 1 <= n <= tgt_len]
    if bad:
        return f"seq_lens: every length is in [1, T = {tgt_len}], got {', '.join(bad)}"
    if schedule is not None:
        return "seq_lens: a packed case has no schedule (packed decode is not in the contract yet), got both"
    return None


def cu_seqlens(seq_lens: Sequence[int]) -> np.ndarray:
    """(B + 1,) int64: the cumulative offsets of the packed sequences, 0, l_0, l_0 + l_1, …, Σ l_b — sequence b
    is packed rows [cu[b], cu[b + 1]) (FlashAttention's varlen ``cu_seqlens``)."""
    return np.concatenate([[0], np.cumsum(np.asarray(seq_lens, dtype=np.int64))])


def key_visible(seq_lens: Sequence[int], src_len: int) -> np.ndarray:
    """(B, 1, 1, S) bool: key j belongs to entry b's sequence when j < l_b."""
    return (np.arange(src_len)[None, :] < np.asarray(seq_lens)[:, None]).reshape(len(seq_lens), 1, 1, src_len)


def nan_padded(x: np.ndarray, seq_lens: Sequence[int]) -> np.ndarray:
    """A copy of ``x`` (B, L, F) with the padding rows ≥ l_b of each entry b set to NaN."""
    out = np.array(x, dtype=np.float64, copy=True)
    out[~key_visible(seq_lens, x.shape[1]).reshape(x.shape[0], x.shape[1])] = np.nan
    return out


def sequence_calls(seq_lens: Sequence[int]) -> list[Call]:
    """Each sequence as the rows it is judged on: sequence b is query rows [0, l_b) against keys [0, l_b)
    of entry b (a :class:`~mhaspec.spec.schedule.Call` of kind "sequence", cache l_b)."""
    return [Call(0, n, n, "sequence") for n in seq_lens]
