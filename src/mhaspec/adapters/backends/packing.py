"""A packed case (``seq_lens``, docs/serving.md) as a packed kernel takes it: the valid rows of every batch
entry concatenated into one (1, N) batch, N = Σ l_b, sequence b at packed rows [cu[b], cu[b + 1])
(``case.cu_seqlens()``), attending with a block-diagonal rule; and its stages back in the canonical padded
layout (B, T, ·).

NumPy only (index arithmetic and the rule's boolean blocks): a framework adapter packs its own tensors
with :func:`packed_rows` as an index and unpacks what it converted back to NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mhaspec.spec import REGISTRY, Case, masks
from mhaspec.spec.packed import sequence_calls
from mhaspec.spec.schedule import call_rows
from mhaspec.spec.variant_ops import alibi, alibi_distance, rope_positions


def _lengths(case: Case) -> tuple[int, ...]:
    if case.seq_lens is None:
        raise ValueError(f"seq_lens: case {case.id!r} is not packed (seq_lens is None)")
    return case.seq_lens


def packed_rows(case: Case) -> np.ndarray:
    """(N,) int64: the flat row b·T + i of each valid row (sequence b's rows [0, l_b)), in packed order."""
    T = case.tgt_len
    return np.concatenate([b * T + np.arange(n, dtype=np.int64) for b, n in enumerate(_lengths(case))])


def pack(case: Case, x: np.ndarray) -> np.ndarray:
    """x (B, T, F) -> (1, N, F): the valid rows of every entry, concatenated."""
    B, T, F = x.shape
    return x.reshape(B * T, F)[packed_rows(case)][None]


def unpack_rows(case: Case, x: np.ndarray) -> np.ndarray:
    """x (1, N, F) (a row stage of the packed call) -> (B, T, F), NaN at every padding row."""
    B, T = case.batch, case.tgt_len
    out = np.full((B * T,) + x.shape[2:], np.nan, dtype=x.dtype)
    out[packed_rows(case)] = x[0]
    return out.reshape((B, T) + x.shape[2:])


def _blocks(case: Case) -> list[tuple[int, int, int]]:
    """(entry b, packed start cu[b], length l_b) of each sequence."""
    cu = case.cu_seqlens()
    return [(b, int(cu[b]), n) for b, n in enumerate(_lengths(case))]


def unpack_heads(case: Case, x: np.ndarray) -> np.ndarray:
    """x (1, H, N, ·) (lse (1, H, N), head_outputs (1, H, N, D_v)) -> (B, H, T, ·), NaN at padding rows."""
    B, T = case.batch, case.tgt_len
    out = np.full((B, x.shape[1], T) + x.shape[3:], np.nan, dtype=x.dtype)
    for b, start, n in _blocks(case):
        out[b, :, :n] = x[0, :, start : start + n]
    return out


def unpack_pairs(case: Case, x: np.ndarray) -> np.ndarray:
    """x (1, H, N, N) (scores, weights of the packed call) -> (B, H, T, S): each sequence's diagonal block,
    NaN at padding rows and keys."""
    B, T, S = case.batch, case.tgt_len, case.src_len
    out = np.full((B, x.shape[1], T, S), np.nan, dtype=x.dtype)
    for b, start, n in _blocks(case):
        out[b, :, :n, :n] = x[0, :, start : start + n, start : start + n]
    return out


def _entry(x: np.ndarray | None, b: int, n: int) -> np.ndarray | None:
    """Entry b's part of a (B|1, H|1, T|1, S) input (mask, bias), rows and keys [0, n)."""
    if x is None:
        return None
    return call_rows(x[b : b + 1] if x.shape[0] > 1 else x, sequence_calls((n,))[0])


def block_diagonal(case: Case, blocks: Sequence[np.ndarray], fill: object) -> np.ndarray:
    """(…, N, N): sequence b's (…, l_b, l_b) block on the diagonal, ``fill`` elsewhere (leading axes broadcast)."""
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in blocks))
    N = int(case.cu_seqlens()[-1])
    out = np.full(lead + (N, N), fill, dtype=np.result_type(*blocks))
    for (_, start, n), x in zip(_blocks(case), blocks):
        out[..., start : start + n, start : start + n] = x
    return out


def packed_allowed(case: Case) -> np.ndarray:
    """(1, H, N, N) bool, True = may attend: block-diagonal from cu_seqlens, each block sequence b's own
    rule (causal, window, its explicit mask; :func:`mhaspec.spec.masks.visibility` on l_b rows and keys)."""
    return block_diagonal(case, [masks.visibility(case.config, _entry(case.inputs.mask, b, n), 1, n, n)
                                 for b, _, n in _blocks(case)], False)


def packed_bias(case: Case) -> np.ndarray | None:
    """(1, H|1, N, N): the additive score bias of each sequence on its block (0 elsewhere), or None."""
    bias = case.inputs.bias
    if bias is None:
        return None
    return block_diagonal(case, [_entry(bias, b, n) for b, _, n in _blocks(case)], 0.0)


def packed_alibi(case: Case) -> np.ndarray | None:
    """(1, H, N, N) float64: ALiBi's term −slope_h·|i − j| within each sequence on its block (0 elsewhere), or
    None without ALiBi."""
    if case.config.alibi_slopes is None:
        return None
    return block_diagonal(case, [alibi(case.config, n, n, n)[None] for _, _, n in _blocks(case)], 0.0)


def packed_score_bias(case: Case) -> np.ndarray | None:
    """(1, H|1, N, N) float64: each sequence's additive bias plus its ALiBi term on its block (0 elsewhere), or
    None when the case has neither."""
    bias, term = packed_bias(case), packed_alibi(case)
    if term is None:
        return bias
    return term if bias is None else bias + term


def packed_distance(case: Case) -> np.ndarray | None:
    """(N, N) int64: ALiBi's |i − j| within each sequence (0 across sequences), or None without ALiBi."""
    if case.config.alibi_slopes is None:
        return None
    return block_diagonal(case, [alibi_distance(case.config, n, n, n) for _, _, n in _blocks(case)], 0)


def packed_positions(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """((N,) query positions, (N,) key positions) for RoPE: each sequence's own, restarting at its start."""
    pairs = [rope_positions(case.config, n, n) for _, _, n in _blocks(case)]
    return np.concatenate([q for q, _ in pairs]), np.concatenate([k for _, k in pairs])


def unpack(case: Case, stages: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every stage of the packed (1, N) call back in the padded layout (B, T, ·) (NaN at padding), by its
    axes: (B, T|S, ·) rows, (B, H, T, S) each sequence's block, (B, H, T, ·) rows of each head."""
    out = {}
    for name, x in stages.items():
        axes = REGISTRY[name].axes
        if axes[1] in ("T", "S"):
            out[name] = unpack_rows(case, x)
        elif axes[2:4] == ("T", "S"):
            out[name] = unpack_pairs(case, x)
        else:
            out[name] = unpack_heads(case, x)
    return out
