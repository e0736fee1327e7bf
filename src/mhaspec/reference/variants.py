"""The float64 reference of the attention variants (docs/spec.md §2a): one small pure function per
operation, exact like :mod:`.mha` (every value rounded once, correctly: :mod:`.rounding`).

Order of operations (the composition is :func:`mhaspec.reference.mha.forward`)::

    q_proj, k_proj ─rope─► q_rot, k_rot ─scale·QKᵀ─► s ─softcap─► c·tanh(s/c) ─+ bias + alibi─► scores
    scores ─softmax over the visible keys, sink logit in the denominator─► attn_weights, lse

A window changes only which keys are visible (:func:`mhaspec.spec.masks.visibility`).

Their backward (docs/backward.md; the composition is :func:`mhaspec.reference.backward.backward`)::

    d_scores ─► d_bias (summed over the axes the bias broadcasts)
             ─► d_sink_logits (−Σ_{B,T} p_sink · δ)
             ─⊙ softcap′ = 1 − tanh²(s/c)─► d_raw ─scale·d_raw K_rot, scale·Σ_group d_rawᵀ Q_rot─► d_q_rot, d_k_rot
    d_q_rot, d_k_rot ─rope turned back (Rᵀ)─► d_q_proj, d_k_proj

ALiBi's slopes are constants: no gradient.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..spec import MHAConfig
from ..spec.masks import alignment_offset
from ..spec.variants import alibi_slope_values
from .mha import _exp, _matmul
from .rounding import exact_sum, log_sum_exp, rope_cos_sin
from .rounding import softcap as _softcap_one
from .rounding import softcap_slope as _softcap_slope_one


def rope(x: np.ndarray, heads: int, positions: np.ndarray, config: MHAConfig, back: bool = False) -> np.ndarray:
    """Rotary embedding of each head's first ``rotary_dim`` features.   x (B, L, heads·D) -> (B, L, heads·D).

    Pair k of row l turns by the angle positions[l] · theta^(−2k/r): (a, b) -> (a·cos − b·sin,
    b·cos + a·sin), where (a, b) is features (k, k + r/2) in style "half" and (2k, 2k + 1) in style
    "interleaved".  cos and sin are correctly rounded; each rotated entry is summed exactly from
    them and rounded once.

    ``back``: turned back by the same angle, (a, b) -> (a·cos + b·sin, b·cos − a·sin): the transpose
    Rᵀ of the rotation, which takes a gradient of the rotated features to that of the unrotated ones
    (d_q_proj = Rᵀ d_q_rot); features past rotary_dim pass through either way."""
    spec = config.rope
    assert spec is not None and spec.rotary_dim is not None
    B, L, F = x.shape
    D, r = F // heads, spec.rotary_dim
    half = r // 2
    if spec.style == "half":
        first, second = np.arange(half), np.arange(half) + half
    else:
        first, second = 2 * np.arange(half), 2 * np.arange(half) + 1
    out = x.copy().reshape(B, L, heads, D)
    rows = x.reshape(B, L, heads, D)
    for l, pos in enumerate(positions.tolist()):
        for k in range(half):
            cos, sin = (Fraction(v) for v in rope_cos_sin(int(pos), k, r, spec.theta))
            sin = -sin if back else sin
            a_idx, b_idx = first[k], second[k]
            for b in range(B):
                for h in range(heads):
                    a, bb = Fraction(float(rows[b, l, h, a_idx])), Fraction(float(rows[b, l, h, b_idx]))
                    out[b, l, h, a_idx] = float(a * cos - bb * sin)
                    out[b, l, h, b_idx] = float(bb * cos + a * sin)
    return out.reshape(B, L, F)


def rope_positions(config: MHAConfig, tgt_len: int, src_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(query positions (T,), key positions (S,)): query_offset + i and key_offset + j."""
    spec = config.rope
    assert spec is not None
    return spec.query_offset + np.arange(tgt_len), spec.key_offset + np.arange(src_len)


def softcap(s: np.ndarray, cap: float) -> np.ndarray:
    """s ← cap · tanh(s / cap), each entry correctly rounded.   (B, H, T, S) -> (B, H, T, S)."""
    flat = [_softcap_one(v, cap) for v in s.ravel().tolist()]
    return np.array(flat, dtype=np.float64).reshape(s.shape)


def alibi_distance(config: MHAConfig, tgt_len: int, src_len: int) -> np.ndarray:
    """(T, S) int: |i + off − j|, the distance of key j from query row i's diagonal
    (off = 0 top-left, S − T bottom-right: the case's ``causal_alignment``)."""
    off = alignment_offset(config, tgt_len, src_len)
    return np.abs(np.arange(tgt_len)[:, None] + off - np.arange(src_len)[None, :])


def add_bias(s: np.ndarray, bias: np.ndarray | None, slopes: np.ndarray | None, distance: np.ndarray) -> np.ndarray:
    """s + bias − slope_h · |i + off − j|, summed exactly and rounded once.

    s (B, H, T, S); bias (B|1, H|1, T, S) or None; slopes (H,) or None; distance (T, S)."""
    B, H, T, S = s.shape
    full_bias = None if bias is None else np.broadcast_to(bias, s.shape)
    out = np.empty_like(s)
    for index in np.ndindex(s.shape):
        b, h, i, j = index
        terms: list[float | Fraction] = [float(s[index])]
        if full_bias is not None:
            terms.append(float(full_bias[index]))
        if slopes is not None:
            terms.append(-Fraction(float(slopes[h])) * int(distance[i, j]))
        out[index] = exact_sum(terms)
    return out


def _sink_softmax_parts(
    s: np.ndarray, visible: np.ndarray, sink_logits: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e (B, H, T, S), e_sink (B, H, T, 1), total (B, H, T, 1)): the softmax-with-sinks' numerators
    e^(s_j − peak) (0 where invisible), the sink's e^(sink_h − peak) (0 for a row that sees no key) and
    their fsum, with peak the row's maximum over the visible scores and the sink; each exp correctly
    rounded."""
    B, H, T, S = s.shape
    sink = np.broadcast_to(np.asarray(sink_logits, dtype=np.float64)[None, :, None, None], (B, H, T, 1))
    row_max = np.max(np.where(visible, s, -np.inf), axis=-1, keepdims=True)  # (B, H, T, 1)
    seen = np.isfinite(row_max)
    peak = np.where(seen, np.maximum(row_max, sink), 0.0)
    e = np.zeros_like(s)
    e[visible] = _exp(s[visible] - np.broadcast_to(peak, s.shape)[visible])
    e_sink = np.where(seen, _exp(sink - peak), 0.0)  # (B, H, T, 1)
    rows = np.concatenate([e, e_sink], axis=-1).reshape(-1, S + 1).tolist()
    total = np.array([math.fsum(r) for r in rows]).reshape(peak.shape)
    return e, e_sink, total


def softmax_with_sinks(s: np.ndarray, visible: np.ndarray, sink_logits: np.ndarray) -> np.ndarray:
    """p_j = e^(s_j) / (Σ_visible e^(s_k) + e^(sink_h)): the sink takes a share of each row, which then
    sums to less than 1.  Invisible entries and rows that see no key are 0.

    s, visible (B, H, T, S); sink_logits (H,).  Like :func:`.mha.softmax`: the row's maximum
    (here over the visible scores and the sink) is subtracted before the correctly rounded exp, and the
    denominator is summed with fsum."""
    e, _, total = _sink_softmax_parts(s, visible, sink_logits)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def sink_weights(s: np.ndarray, visible: np.ndarray, sink_logits: np.ndarray) -> np.ndarray:
    """p_sink = e^(sink_h) / (Σ_visible e^(s_k) + e^(sink_h)), the sink's share of each row (= e^(sink_h −
    lse)), computed like the row's attention weights (:func:`softmax_with_sinks`); 0 for a row that sees
    no key.   s, visible (B, H, T, S); sink_logits (H,) -> (B, H, T)."""
    _, e_sink, total = _sink_softmax_parts(s, visible, sink_logits)
    return np.divide(e_sink, total, out=np.zeros_like(e_sink), where=total > 0)[..., 0]


def lse(s: np.ndarray, visible: np.ndarray, sink_logits: np.ndarray | None) -> np.ndarray:
    """ln(Σ_visible e^(s_j) [+ e^(sink_h)]), the natural log of the softmax's denominator, correctly
    rounded; −inf for a row that sees no key (with or without a sink).   (B, H, T, S) -> (B, H, T)."""
    B, H, T, S = s.shape
    out = np.empty((B, H, T))
    for b, h, i in np.ndindex(B, H, T):
        values = s[b, h, i][visible[b, h, i]].tolist()
        if values and sink_logits is not None:
            values.append(float(sink_logits[h]))
        out[b, h, i] = log_sum_exp(values)
    return out


def alibi_slopes(config: MHAConfig) -> np.ndarray | None:
    """(H,) float64 slopes, or None without ALiBi (:func:`mhaspec.spec.variants.alibi_slope_values`)."""
    return alibi_slope_values(config)


# -- the backward ------------------------------------------------------------------------------------

def softcap_back(dS: np.ndarray, raw: np.ndarray, cap: float) -> np.ndarray:
    """d_raw = d_scores ⊙ (1 − tanh²(raw / cap)), the gradient of the raw score scale·Q_rot K_rotᵀ
    through softcap: softcap′ correctly rounded from the float64 raw score
    (:func:`.rounding.softcap_slope`), the product rounded once.   dS, raw (B, H, T, S) -> (B, H, T, S)."""
    slope = [_softcap_slope_one(v, cap) for v in raw.ravel().tolist()]
    return dS * np.array(slope, dtype=np.float64).reshape(raw.shape)


def d_sink_logits(p_sink: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """−Σ_{b, i} p_sink · δ per head, one fsum of the rounded products over (b, i).

    p_sink (B, H, T) (:func:`sink_weights`), δ (B, H, T) (Σ_visible P ⊙ dP per row) -> (H,)."""
    B, H, T = p_sink.shape
    rows = np.moveaxis(p_sink, 1, 0).reshape(H, 1, B * T)  # (H, 1, B·T)
    cols = np.moveaxis(delta, 1, 0).reshape(H, B * T, 1)  # (H, B·T, 1)
    return -_matmul(rows, cols)[:, 0, 0]


def d_bias(dS: np.ndarray, bias_shape: tuple[int, ...]) -> np.ndarray:
    """d_scores summed, one fsum per entry, over the axes the bias broadcasts (B when its first axis is 1,
    H when its second is).   dS (B, H, T, S) -> bias_shape (B|1, H|1, T, S)."""
    summed = tuple(axis for axis in (0, 1) if bias_shape[axis] == 1)
    kept_last = np.moveaxis(dS, summed, tuple(range(dS.ndim - len(summed), dS.ndim)))  # (kept…, summed…)
    rows = kept_last.reshape(-1, math.prod(dS.shape[a] for a in summed)).tolist()
    return np.array([math.fsum(r) for r in rows], dtype=np.float64).reshape(bias_shape)
