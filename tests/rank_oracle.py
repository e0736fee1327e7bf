"""The oracle of the rank tests until the judge is used: each rank's exact golden
(:func:`mhaspec.reference.ranks.rank_stages`) and plain comparisons against it."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mhaspec.reference.onthefly import golden_case
from mhaspec.reference.ranks import rank_stages
from mhaspec.spec import CATALOG, REGISTRY, CaseSpec, compared_entries
from mhaspec.spec.ranks import Layout, attention_heads, attention_rows, rank_stage_names
from mhaspec.spec.stages import forward_stages


@lru_cache(maxsize=None)
def golden(case_id: str):
    return golden_case(CATALOG[case_id])


@lru_cache(maxsize=None)
def golden_ranks(case_id: str, layout: Layout) -> tuple[dict[str, np.ndarray], ...]:
    """Every rank's exact golden stages (float64) of catalog case ``case_id`` sharded by ``layout``."""
    g = golden(case_id)
    return tuple(rank_stages(g.stages, g.visible, g.weights, g.spec.config, layout, r) for r in range(layout.world))


def shardable(layout: Layout, *, ids: tuple[str, ...] | None = None) -> list[CaseSpec]:
    """The catalog cases ``layout`` can shard (no decode schedule, not packed; :meth:`Layout.problem` says none)."""
    return [s for s in CATALOG if s.schedule is None and s.seq_lens is None and (ids is None or s.id in ids)
            and layout.problem(s.config, s.tgt_len, s.src_len) is None]


def relative_error(got: object, want: np.ndarray, compared: np.ndarray | None = None) -> float:
    """max |got − want| / max |want| over the finite entries of ``want`` that are ``compared`` (a bool mask of
    want's shape; None: every entry) — inf where the non-finite entries, or the shape, differ."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return np.inf
    if compared is not None:
        got, want = got[compared], want[compared]
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        return np.inf
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(want[finite]).max()), np.finfo(np.float64).tiny)
    return float(np.abs(got[finite] - want[finite]).max()) / scale


def rank_visible(case_id: str, layout: Layout, rank: int) -> np.ndarray:
    """(B, h, t, S) bool: the case's visibility of the rank's attention heads and rows."""
    g = golden(case_id)
    h0, h1 = attention_heads(layout, g.spec.config, rank)
    return g.visible[:, h0:h1][:, :, attention_rows(layout, g.spec.tgt_len, rank)]


def first_differences(got: list[dict], case_id: str, layout: Layout, threshold: float = 0.0) -> dict[int, str]:
    """Per rank, the first stage (in the judge's order: :func:`rank_stage_names`) where ``got`` differs from the
    rank's exact golden by more than ``threshold`` relative, over the entries the judge compares (a masked score
    is not: :func:`compared_entries`); ranks where none does are left out."""
    cfg = CATALOG[case_id].config
    out = {}
    for r, (x, want) in enumerate(zip(got, golden_ranks(case_id, layout))):
        visible = rank_visible(case_id, layout, r)
        for stage in rank_stage_names(layout, forward_stages(cfg)):
            if stage not in want:
                continue
            compared = compared_entries(stage, visible) if stage in REGISTRY else None
            if stage not in x or relative_error(x[stage], want[stage], compared) > threshold:
                out[r] = stage
                break
    return out
