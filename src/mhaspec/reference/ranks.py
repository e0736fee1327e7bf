"""The golden of one rank of a sharded run (docs/distributed.md, :mod:`mhaspec.spec.ranks`).

Every stage of a rank is a slice of the case's golden forward stages, except two kinds, computed here
from the golden's stages with the reference's own correctly rounded functions (:mod:`.mha`):

* ``o_partial`` — the rank's concat columns times its rows of W^O, no b_o (one fsum per entry);
* ``ring_out[k]`` / ``ring_lse[k]`` — the softmax over the rank's attention rows of the golden scores
  restricted to the keys seen by step k, times V; and its log-sum-exp (sinks as in the spec).

Both start from the golden's float64 stages (``concat``, ``scores``, ``v_proj``), each within a few
float64 units of the exact value, so these are too: far below any dtype's tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..spec.config import MHAConfig
from ..spec.ranks import (Layout, attention_heads, attention_rows, head_range, kv_head_range, own_keys, own_rows,
                          rank_stage_names, ring_stage, seen_keys_at)
from . import mha, variants

_QUERY_SIDE = ("q_proj", "q_rot")
_KEY_SIDE = ("k_proj", "k_rot")
_ATTENTION = ("scores", "attn_weights", "head_outputs", "lse")


def _columns(heads: tuple[int, int], width: int) -> slice:
    return slice(heads[0] * width, heads[1] * width)


def rank_stages(stages: Mapping[str, np.ndarray], visible: np.ndarray, weights: Mapping[str, np.ndarray],
                config: MHAConfig, layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s golden stages (float64) from the case's golden forward ``stages`` (by name, canonical
    shapes), its (B, H, T, S) ``visible`` and ``weights``: every forward stage the case has, sliced, plus
    ``o_partial`` (tp > 1) and the ring steps (ring, cp > 1)."""
    B, T, _ = stages["q_proj"].shape
    S = stages["k_proj"].shape[1]
    rows, keys = own_rows(layout, T, rank), own_keys(layout, S, rank)
    heads, kv = head_range(layout, config, rank), kv_head_range(layout, config, rank)
    a_heads, a_rows = attention_heads(layout, config, rank), attention_rows(layout, T, rank)
    out: dict[str, np.ndarray] = {}
    for name in rank_stage_names(layout, tuple(stages)):
        if name in _QUERY_SIDE and name in stages:
            out[name] = stages[name][:, rows, _columns(heads, config.D_k)]
        elif name in _KEY_SIDE and name in stages:
            out[name] = stages[name][:, keys, _columns(kv, config.D_k)]
        elif name == "v_proj":
            out[name] = stages[name][:, keys, _columns(kv, config.D_v)]
        elif name in _ATTENTION and name in stages:
            out[name] = stages[name][:, a_heads[0]:a_heads[1]][:, :, a_rows]
        elif name == "concat":
            out[name] = stages[name][:, rows, _columns(heads, config.D_v)]
        elif name == "output":
            out[name] = stages[name][:, rows]
        elif name == "o_partial":
            c = stages["concat"][:, rows, _columns(heads, config.D_v)]
            out[name] = mha.output_projection(c, np.asarray(weights["w_o"])[_columns(heads, config.D_v)], None)
    if layout.cp > 1 and layout.strategy == "ring":
        out.update(ring_steps(stages, visible, weights, config, layout, rank))
    return out


def ring_steps(stages: Mapping[str, np.ndarray], visible: np.ndarray, weights: Mapping[str, np.ndarray],
               config: MHAConfig, layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """``ring_out[k]`` (B, h, t, D_v) and ``ring_lse[k]`` (B, h, t) for k = 0 … cp − 1: the attention of the
    rank's heads and rows over the keys it has held by step k."""
    T, S = stages["scores"].shape[2:]
    h0, h1 = attention_heads(layout, config, rank)
    rows = attention_rows(layout, T, rank)
    s = stages["scores"][:, h0:h1][:, :, rows]
    vis = visible[:, h0:h1][:, :, rows]
    V = mha.repeat_kv(mha.split_heads(stages["v_proj"], config.H_kv), config.group_size)[:, h0:h1]
    sinks = np.asarray(weights["sink_logits"])[h0:h1] if config.sinks else None
    out: dict[str, np.ndarray] = {}
    for k in range(layout.cp):
        seen = vis & seen_keys_at(layout, S, rank, k)
        p = mha.softmax(s, seen) if sinks is None else variants.softmax_with_sinks(s, seen, sinks)
        out[ring_stage("out", k)] = mha.weighted_sum(p, V)
        out[ring_stage("lse", k)] = variants.lse(s, seen, sinks)
    return out
