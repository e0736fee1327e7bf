"""The oracle of the rank tests until the judge is used: each rank's exact golden
(:func:`mhaspec.reference.ranks.rank_stages`) and plain comparisons against it."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mhaspec.reference.onthefly import golden_case
from mhaspec.reference.ranks import rank_stages
from mhaspec.spec import CATALOG, CaseSpec
from mhaspec.spec.ranks import Layout, rank_stage_names


@lru_cache(maxsize=None)
def golden(case_id: str):
    return golden_case(CATALOG[case_id])


@lru_cache(maxsize=None)
def golden_ranks(case_id: str, layout: Layout) -> tuple[dict[str, np.ndarray], ...]:
    """Every rank's exact golden stages (float64) of catalog case ``case_id`` sharded by ``layout``."""
    g = golden(case_id)
    return tuple(rank_stages(g.stages, g.visible, g.weights, g.spec.config, layout, r) for r in range(layout.world))


def shardable(layout: Layout, *, ids: tuple[str, ...] | None = None) -> list[CaseSpec]:
    """The catalog cases ``layout`` can shard (no decode schedule; :meth:`Layout.problem` says none)."""
    return [s for s in CATALOG if s.schedule is None and (ids is None or s.id in ids)
            and layout.problem(s.config, s.tgt_len, s.src_len) is None]


def relative_error(got: object, want: np.ndarray) -> float:
    """max |got − want| / max |want| over the finite entries of ``want`` (inf where the non-finite entries,
    or the shape, differ)."""
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        return np.inf
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        return np.inf
    if not finite.any():
        return 0.0
    scale = max(float(np.abs(want[finite]).max()), np.finfo(np.float64).tiny)
    return float(np.abs(got[finite] - want[finite]).max()) / scale


def stage_order(layout: Layout, stages: dict[str, np.ndarray]) -> list[str]:
    """The names of ``stages`` in pipeline order (:func:`rank_stage_names`)."""
    forward = tuple(s for s in ("q_proj", "k_proj", "v_proj", "q_rot", "k_rot", "scores", "attn_weights", "lse",
                                "head_outputs", "concat", "output") if s in stages)
    return [s for s in rank_stage_names(layout, forward) if s in stages]


def first_differences(a: list[dict], b: list[dict], layout: Layout, threshold: float = 0.0
                      ) -> dict[int, str]:
    """Per rank, the first stage (pipeline order) where the stages of ``a`` differ from those of ``b`` by more
    than ``threshold`` (relative to ``b``'s); ranks where none does are left out."""
    out = {}
    for r, (x, y) in enumerate(zip(a, b)):
        for stage in stage_order(layout, y):
            if stage not in x or relative_error(x[stage], np.asarray(y[stage], dtype=np.float64)) > threshold:
                out[r] = stage
                break
    return out
