"""Judging one case of a sharded run, rank by rank (docs/distributed.md).

Each rank's stages are judged against the slice of the golden it owns (:mod:`mhaspec.spec.ranks`), with
the tolerance model and the local checks that judge any case, through *views* of the golden: cases of
their own that the model already knows, as decode.py's calls are.

* :func:`head_view` — a tensor-parallel rank's heads: an MHA case with its H/tp query heads and the
  key/value heads they read, its columns of W^Q, W^K, W^V and rows of W^O, no b_o — whose ``output`` is
  the rank's ``o_partial``;
* its rows: blocks of query rows of that view (:func:`mhaspec.conformance.blocks.block_case`; a zigzag
  rank owns two blocks), judged one block at a time and merged (:func:`mhaspec.conformance.blocks.merge`);
* ulysses' attention stages: the head view of the rank's share of its tp heads, every row;
* :func:`ring_view` — ring step k: the head view with every row's visibility ANDed with the keys seen
  by step k (its ``head_outputs`` and ``lse`` are ``ring_out[k]``, ``ring_lse[k]``), its bound widened by
  the rounding of the k log-sum-exp merges (:func:`mhaspec.conformance.model.ranks.merges`);
* the reduced ``output`` (tp > 1): the case itself, its output's bound widened by the rounding of the
  all-reduce of the partials (:func:`mhaspec.conformance.model.ranks.reduction`);
* a context-parallel rank's key rows (``k_proj``, ``v_proj``, ``k_rot``): its rows of the head view's
  golden and bounds (golden check only: no view of a subset of keys keeps RoPE's key positions).

The case's verdict is its first failing rank's (then the first known deviation, the first
uninformative one), worded ``rank 1 of 4 (tp 1, cp 0), step 2 of 4: ring_lse[1] fails — …``.  A rank
that crashed or hung makes the case an ``error`` naming the rank.  Collectives: where the adapter
promises a count per kind and the launcher counted what each rank issued, a rank that issued other
counts fails (:func:`collectives_problem`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import MhaspecError
from ..fixtures import GoldenCase, StageErrors
from ..protocol.ranks import RankLauncher, RankReply
from ..reference import mha
from ..reference.ranks import rank_stages
from ..spec import REGISTRY, STAGE
from ..spec.config import MHAConfig
from ..spec.ranks import (Layout, attention_heads, attention_rows, chunks, head_range, kv_head_range, parse_ring_stage,
                          rank_stage_names, ring_source, ring_stage, seen_keys_at)
from ..spec.stages import WEIGHT_AXES, forward_stages
from ..spec.tolerance import DEFAULT_TOLERANCES
from ..spec.variants import alibi_slope_values
from . import second_opinion
from .blocks import ROW_AXIS, _slice_stage, block_case, merge
from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, PASS, UNINFORMATIVE, StageResult, compare_stage
from .decode import verdict_of
from .judging import judging_block
from .model import ranks as rank_rules
from .model.vocabulary import KAPPA, KAPPA_MIN_ELEMENTS, Bound, rounding
from .report import ERROR, RankResult
from .tolerance import judging_bounds

#: The launcher of each ``adapter.launcher`` name, imported when first used (``module:Class``).
LAUNCHERS: dict[str, str] = {
    "threads": "mhaspec.protocol.transports.threads_ranks:ThreadsLauncher",
    "torch": "mhaspec.protocol.transports.torch_ranks:TorchLauncher",
    "jax": "mhaspec.protocol.transports.jax_ranks:JaxLauncher",
}

#: Why a case with a schedule is not judged with a distributed adapter.
NO_SCHEDULE = "a case with a schedule (decode) is not sharded: a distributed adapter runs run_rank(ctx, case) only"
#: Why a packed case is not judged with a distributed adapter (its ranks would read the NaN padding rows).
NO_PACKED = ("a packed case (seq_lens) is not sharded: its padding rows are NaN and no layout of docs/distributed.md "
             "cuts sequences")
#: Why a distributed adapter's backward stages are not judged.
FORWARD_ONLY = "a distributed adapter is judged forward only (run_rank; docs/distributed.md)"

#: The rank stages whose rows are key rows (a cp rank's own keys).
KEY_SIDE = (STAGE.k_proj, STAGE.v_proj, STAGE.k_rot)
#: The attention stages (the rank's attention heads × attention rows × every key).
ATTENTION = (STAGE.scores, STAGE.attn_weights, STAGE.head_outputs, STAGE.lse)

Judge = Callable[[GoldenCase, Mapping[str, Any]], list[StageResult]]


def launcher_for(name: str) -> RankLauncher:
    """A new launcher of kind ``name`` (:data:`LAUNCHERS`), its module imported now."""
    if name not in LAUNCHERS:
        raise MhaspecError(f"adapter.launcher = {name!r}: not one of {', '.join(LAUNCHERS)} (docs/distributed.md)")
    module, attr = LAUNCHERS[name].split(":")
    try:
        return getattr(importlib.import_module(module), attr)()
    except (ImportError, AttributeError) as exc:
        raise MhaspecError(f"launcher {name!r} ({LAUNCHERS[name]}) is not usable here: {type(exc).__name__}: {exc}"
                           ) from exc


def rank_label(layout: Layout, rank: int) -> str:
    """``rank 1 of 4 (tp 1, cp 0)``."""
    tp, cp = layout.coords(rank)
    return f"rank {rank} of {layout.world} (tp {tp}, cp {cp})"


def where(layout: Layout, rank: int, stage: str) -> str:
    """``rank 1 of 4 (tp 1, cp 0)``, with ``, step 2 of 4`` for ring stage ``ring_out[1]`` / ``ring_lse[1]``."""
    k = step_of(stage)
    return rank_label(layout, rank) + ("" if k is None else f", step {k + 1} of {layout.cp}")


def step_of(stage: str) -> int | None:
    """The ring step k of ``ring_out[k]`` / ``ring_lse[k]``; None for any other stage."""
    parsed = parse_ring_stage(stage)
    return None if parsed is None else parsed[1]


# --- views -------------------------------------------------------------------------------------------

def _heads_slice(axes: tuple[str, ...], x: Any, config: MHAConfig, heads: tuple[int, int], kv: tuple[int, int]
                 ) -> Any:
    """``x`` (a stage's or a weight's value, of axes ``axes``) cut to query heads ``heads`` and key/value heads
    ``kv`` on its head axis (``H``, ``H·D_k``, ``H_kv·D_v``, …: as :attr:`Stage.heads` finds it)."""
    axis = next((i for i, a in enumerate(axes) if a.split("·")[0] in ("H", "H_kv")), None)
    if isinstance(x, float) or axis is None:
        return x
    first, _, width = axes[axis].partition("·")
    lo, hi = heads if first == "H" else kv
    w = {"": 1, "D_k": config.D_k, "D_v": config.D_v}[width]
    return x[(slice(None),) * axis + (slice(lo * w, hi * w),)]


def _input_heads(name: str, x: np.ndarray, heads: tuple[int, int]) -> np.ndarray:
    """Input ``name`` cut to query heads ``heads``: the mask and the additive bias (B|1, H|1, T|1, S) where
    they have a head axis; query, key and value unchanged."""
    if name in ("mask", "bias") and x.shape[1] > 1:
        return x[:, heads[0]:heads[1]]
    return x


def head_view(golden: GoldenCase, heads: tuple[int, int], kv: tuple[int, int]) -> GoldenCase:
    """The case restricted to query heads [h0, h1) and the key/value heads [g0, g1) they read: an MHA case
    of h1 − h0 heads, its columns of W^Q, W^K, W^V and rows of W^O, **no b_o**, whose ``output`` is those
    heads' concat times those rows of W^O (the rank's ``o_partial``).  Every head: the case itself."""
    cfg = golden.spec.config
    if heads == (0, cfg.H):
        return golden
    slopes = alibi_slope_values(cfg)
    sub = MHAConfig.model_validate({
        **cfg.model_dump(), "num_heads": heads[1] - heads[0], "num_kv_heads": kv[1] - kv[0],
        "head_dim": cfg.D_k, "value_head_dim": cfg.D_v, "scale": cfg.scale,
        **({} if slopes is None else {"alibi_slopes": tuple(float(x) for x in slopes[heads[0]:heads[1]])})})
    weights = {name: _heads_slice(WEIGHT_AXES[name], w, cfg, heads, kv)
               for name, w in golden.weights.items() if name != "b_o"}
    stages = {name: _heads_slice(REGISTRY[name].axes, x, cfg, heads, kv)
              for name, x in golden.stages.items() if name in ROW_AXIS}
    stages[STAGE.output] = mha.output_projection(stages[STAGE.concat], weights["w_o"], None)  # (B, T, d_out)
    error = golden.reference_error
    if error is not None:
        e_c = error.get(STAGE.concat, 0.0)
        error = StageErrors({name: _heads_slice(REGISTRY[name].axes, e, cfg, heads, kv)
                             for name, e in error.items() if name in ROW_AXIS})
        e_c = _heads_slice(REGISTRY[STAGE.concat].axes, e_c, cfg, heads, kv)
        error[STAGE.output] = e_c if isinstance(e_c, float) else e_c @ np.abs(weights["w_o"])  # from concat's
    return dataclasses.replace(
        golden, spec=golden.spec.model_copy(update={"config": sub}),
        inputs={k: _input_heads(k, v, heads) for k, v in golden.inputs.items()},
        weights=weights, stages=stages, visible=golden.visible[:, heads[0]:heads[1]], d_output=None,
        reference_error=error, sha256=None, _cases={})


def _widened(golden: GoldenCase, extra: Mapping[str, np.ndarray]) -> StageErrors:
    """The golden's own error with ``extra`` added (the view's bound widened by it, worst-case:
    :func:`mhaspec.conformance.judging.with_reference_error`)."""
    error = StageErrors(golden.reference_error or {})
    for name, e in extra.items():
        error[name] = error[name] + e
    return error


def reduced_view(golden: GoldenCase, layout: Layout, dtype: str) -> GoldenCase:
    """The case, its ``output``'s bound widened by the all-reduce of the tp partials (tp > 1)."""
    cfg = golden.spec.config
    per = cfg.H // layout.tp
    partials = [mha.output_projection(golden.stages[STAGE.concat][:, :, t * per * cfg.D_v:(t + 1) * per * cfg.D_v],
                                      golden.weights["w_o"][t * per * cfg.D_v:(t + 1) * per * cfg.D_v], None)
                for t in range(layout.tp)]  # (B, T, d_out) each
    u = DEFAULT_TOLERANCES.dtypes[dtype].unit_roundoff
    term = rank_rules.reduction(partials, golden.weights.get("b_o"), u)
    return dataclasses.replace(golden, reference_error=_widened(golden, {STAGE.output: term}), sha256=None, _cases={})


def _block_attention(s: np.ndarray, visible: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(head outputs (B, h, t, D_v), LSE (B, h, t)) of the scores ``s`` (B, h, t, S) over the ``visible`` keys
    alone, in float64 (the magnitudes the merge terms are made of, not a golden): 0 and −inf for a row that
    sees none."""
    top = np.max(np.where(visible, s, -np.inf), axis=-1, keepdims=True)  # (B, h, t, 1)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(visible, np.exp(np.where(visible, s - top, 0.0)), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + top, -np.inf)[..., 0]
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0) @ V, lse


def _rows_set(full: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A copy of ``full`` (B, h, T, …) whose rows ``rows`` (axis 2) are ``values``."""
    out = np.array(full, dtype=np.float64, copy=True)
    out[:, :, rows] = values
    return out


def ring_views(view: GoldenCase, layout: Layout, rank: int, expected: Mapping[str, np.ndarray], dtype: str,
               precision: str) -> list[GoldenCase]:
    """Ring step k = 0 … cp − 1 of ``view`` (the rank's head view, judged on the rank's rows): its visibility
    ANDed with the keys seen by step k; on the rank's rows, its ``head_outputs`` and ``lse`` the rank's golden
    ``ring_out[k]``, ``ring_lse[k]`` (``expected``: :func:`mhaspec.reference.ranks.rank_stages`) and its
    ``attn_weights`` exp(s − ring_lse[k]) over the seen keys; those two bounds widened by the rounding of the
    k merges so far (:func:`mhaspec.conformance.model.ranks.merges`)."""
    cfg = view.spec.config
    T, S = view.visible.shape[2:]
    rows = attention_rows(layout, T, rank)
    s = view.stages[STAGE.scores][:, :, rows]  # (B, h, t, S)
    V = mha.repeat_kv(mha.split_heads(view.stages[STAGE.v_proj], cfg.H_kv), cfg.group_size)  # (B, h, S, D_v)
    c = layout.coords(rank).cp
    seen = [view.visible & seen_keys_at(layout, S, rank, k) for k in range(layout.cp)]  # (B, h, T, S) each
    blocks = []
    for k in range(layout.cp):
        block = np.zeros(S, dtype=bool)
        for a, b in chunks(S, layout, ring_source(layout, c, k)):
            block[a:b] = True
        blocks.append(_block_attention(s, view.visible[:, :, rows] & block, V))
    lse = [expected[ring_stage(STAGE.lse, k)] for k in range(layout.cp)]
    out = [expected[ring_stage("out", k)] for k in range(layout.cp)]
    r = rounding(dtype, precision, DEFAULT_TOLERANCES)
    e_out, e_lse = rank_rules.merges(lse, out, [b[1] for b in blocks], [b[0] for b in blocks], r.u, r.acc)
    whole_lse = view.stages.get(STAGE.lse, np.zeros(view.visible.shape[:3]))
    views = []
    for k in range(layout.cp):
        vis = seen[k][:, :, rows]
        on = vis & np.isfinite(lse[k])[..., None]  # (a row that has seen no key: 0)
        p = np.where(on, np.exp(np.where(on, s - np.where(on, lse[k][..., None], 0.0), 0.0)), 0.0)
        stages = {**view.stages, STAGE.attn_weights: _rows_set(view.stages[STAGE.attn_weights], rows, p),
                  STAGE.head_outputs: _rows_set(view.stages[STAGE.head_outputs], rows, out[k]),
                  STAGE.lse: _rows_set(whole_lse, rows, lse[k])}
        extra = {STAGE.head_outputs: _rows_set(np.zeros(view.stages[STAGE.head_outputs].shape), rows, e_out[k]),
                 STAGE.lse: _rows_set(np.zeros(whole_lse.shape), rows, e_lse[k])}
        views.append(dataclasses.replace(view, visible=seen[k], stages=stages,
                                         reference_error=_widened(view, extra), sha256=None, _cases={}))
    return views


# --- judging -----------------------------------------------------------------------------------------

def _judge_rows(view: GoldenCase, spans: Sequence[tuple[int, int]], arrays: Mapping[str, Any], judge: Judge
                ) -> dict[str, StageResult]:
    """The stages ``arrays`` (rows: the spans' rows, concatenated) judged against ``view``'s rows ``spans``,
    one block of rows per batch entry and span (:func:`block_case`), merged per stage; the key-side stages
    (no row axis) in each batch entry's first block."""
    per_stage: dict[str, list[tuple[tuple[int, int, int], StageResult]]] = {}
    for b in range(view.spec.batch):
        memo: dict[Any, Any] = {}
        offset = 0
        for i, (t0, t1) in enumerate(spans):
            sub = {stage: _slice_stage(stage, a, b, offset, offset + t1 - t0) if isinstance(a, np.ndarray) else a
                   for stage, a in arrays.items()}
            offset += t1 - t0
            with judging_block(block_case(view, b, t0, t1), view, memo, key_stages=i == 0) as block:
                results = judge(block, sub)
            for res in results:
                if res.stage in arrays and (ROW_AXIS[res.stage] is not None or i == 0):
                    per_stage.setdefault(res.stage, []).append(((b, t0, t1), res))
    merged = {stage: merge(parts) for stage, parts in per_stage.items()}
    for st in merged.values():
        second_opinion.fold(st)
    return merged


def _judge_keys(view: GoldenCase, keys: np.ndarray, arrays: Mapping[str, np.ndarray], dtype: str, precision: str
                ) -> dict[str, StageResult]:
    """A cp rank's key rows ``keys`` of the key-side stages, against those rows of ``view``'s golden and
    bounds (the golden check and the mean-square test; no local check)."""
    raw, tolerances = judging_bounds(view, dtype, precision)
    out = {}
    for stage, got in arrays.items():
        cut = (slice(None), keys)
        bound = raw[stage]
        noise = Bound(*(x if np.ndim(x) == 0 else np.broadcast_to(x, tolerances[stage].shape)[cut] for x in bound))
        res = compare_stage(stage, got, view.stages[stage][cut], tolerances[stage][cut], dtype, None, noise=noise,
                            rms_limit=KAPPA**0.5 if precision == "standard" else None,
                            rms_min_elements=KAPPA_MIN_ELEMENTS)
        if res.message:
            res.message = f"[the rank's key rows {_spans_text(keys)}; indices within them] {res.message}"
        if res.verdict == FAIL and not res.failed_check:
            res.failed_check = "golden"
        out[stage] = res
    return out


def _spans_text(index: np.ndarray) -> str:
    """``0:4, 12:16`` for the increasing positions ``index``."""
    cuts = np.flatnonzero(np.diff(index) != 1) + 1
    return ", ".join(f"{int(part[0])}:{int(part[-1]) + 1}" for part in np.split(index, cuts) if len(part))


def _renamed(res: StageResult, name: str) -> StageResult:
    return dataclasses.replace(res, stage=name)


def contract_problem(returned: Any, expected: Mapping[str, np.ndarray], label: str) -> str:
    """Why what a rank returned cannot be judged ("" when it can): not a mapping, a stage a rank of this
    layout does not have, or no ``output``."""
    if not isinstance(returned, Mapping):
        return f"{label}: run_rank() returned {type(returned).__name__}, expected a mapping of stage name to array"
    unknown = [str(k) for k in returned if k not in expected]
    if unknown:
        return (f"{label}: run_rank() returned unknown stage(s) {', '.join(unknown)}; a rank of this layout "
                f"returns {', '.join(expected)}")
    if STAGE.output not in returned:
        return f"{label}: run_rank() did not return the required stage {STAGE.output!r}"
    return ""


def _whole(golden: GoldenCase) -> GoldenCase:
    """``golden`` as a plain :class:`GoldenCase`: a case made one block of rows at a time
    (fixtures.RowBlocks) would give its own blocks, not a view's; its stages are computed whole when read."""
    if not hasattr(golden, "block"):
        return golden
    return GoldenCase(**{f.name: getattr(golden, f.name) for f in dataclasses.fields(GoldenCase)})


def judge_rank(golden: GoldenCase, layout: Layout, rank: int, returned: Mapping[str, Any], judge: Judge,
               dtype: str, precision: str) -> list[StageResult]:
    """Rank ``rank``'s stage results, in :func:`rank_stage_names` order (already through
    :func:`contract_problem`): each stage judged against its view (module docstring)."""
    golden = _whole(golden)
    cfg = golden.spec.config
    T, S = golden.visible.shape[2:]
    expected = rank_stages(golden.stages, golden.visible, golden.weights, cfg, layout, rank)
    results: dict[str, StageResult] = {}
    arrays: dict[str, Any] = {}
    for stage, value in returned.items():
        array = np.asarray(value) if not isinstance(value, np.ndarray) else value
        if array.shape != expected[stage].shape:
            results[stage] = StageResult(stage, FAIL, failed_check="golden", message=(
                f"shape {array.shape}, expected {expected[stage].shape} for {rank_label(layout, rank)} of layout "
                f"{layout.describe()} (docs/distributed.md)"))
        else:
            arrays[stage] = array
    c = layout.coords(rank).cp
    spans = chunks(T, layout, c)
    heads, kv = head_range(layout, cfg, rank), kv_head_range(layout, cfg, rank)
    view = head_view(golden, heads, kv)
    ulysses = layout.cp > 1 and layout.strategy == "ulysses"
    with_rows = [s for s in arrays if s in (STAGE.q_proj, STAGE.q_rot, STAGE.concat)]
    if not ulysses:
        with_rows += [s for s in arrays if s in ATTENTION]
    if layout.cp == 1:
        with_rows += [s for s in arrays if s in KEY_SIDE]
    mapping = {s: arrays[s] for s in with_rows}
    own_output = "o_partial" if layout.tp > 1 else STAGE.output
    if own_output in arrays:
        mapping[STAGE.output] = arrays[own_output]
    for stage, res in _judge_rows(view, spans, mapping, judge).items():
        results[own_output if stage == STAGE.output else stage] = \
            _renamed(res, own_output) if stage == STAGE.output else res
    if ulysses:
        a_heads = attention_heads(layout, cfg, rank)
        group = cfg.group_size
        a_view = head_view(golden, a_heads, (a_heads[0] // group, (a_heads[1] - 1) // group + 1))
        results.update(_judge_rows(a_view, [(0, T)], {s: arrays[s] for s in arrays if s in ATTENTION}, judge))
    if layout.cp > 1:
        keys = np.concatenate([np.arange(a, b) for a, b in chunks(S, layout, c)])
        results.update(_judge_keys(view, keys, {s: arrays[s] for s in arrays if s in KEY_SIDE}, dtype, precision))
    if layout.cp > 1 and layout.strategy == "ring" and any(step_of(s) is not None for s in arrays):
        for k, ring in enumerate(ring_views(view, layout, rank, expected, dtype, precision)):
            names = {STAGE.head_outputs: ring_stage("out", k), STAGE.lse: ring_stage(STAGE.lse, k)}
            step = {stage: arrays[name] for stage, name in names.items() if name in arrays}
            for stage, res in _judge_rows(ring, spans, step, judge).items():
                results[names[stage]] = _renamed(res, names[stage])
    if layout.tp > 1 and STAGE.output in arrays:
        reduced = _judge_rows(reduced_view(golden, layout, dtype), spans, {STAGE.output: arrays[STAGE.output]}, judge)
        results.update(reduced)
    order = rank_stage_names(layout, forward_stages(cfg))
    listed = [results[s] if s in results else StageResult(s, NOT_EXPOSED) for s in order
              if s in results or (s in expected and s != STAGE.lse and step_of(s) is None)]
    return listed


def collectives_problem(promised: Mapping[str, int] | None, issued: Mapping[str, int] | None) -> str:
    """Why the collectives a rank issued break the layout's promise ("" when they keep it, or when either is
    unknown): the counts per kind, zero counts ignored — e.g. ``promised all_reduce 1, issued all_gather 3``."""
    if promised is None or issued is None:
        return ""
    want = {k: int(v) for k, v in promised.items() if v}
    got = {k: int(v) for k, v in issued.items() if v}
    if want == got:
        return ""

    def text(counts: Mapping[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"

    hint = " (falls back to gathering everything?)" if got.get("all_gather", 0) > want.get("all_gather", 0) else ""
    return f"collectives: promised {text(want)}, issued {text(got)}{hint}"


def _rank_result(layout: Layout, rank: int, stages: list[StageResult], error: str = "", collectives: str = "",
                 issued: Mapping[str, int] | None = None) -> RankResult:
    tp, cp = layout.coords(rank)
    base = dict(rank=rank, world=layout.world, tp=tp, cp=cp, issued=None if issued is None else dict(issued))
    if error:
        return RankResult(**base, verdict=ERROR, message=error)
    verdict = verdict_of(stages)
    failing = next((st for st in stages if st.verdict == FAIL), None)
    if collectives and failing is None:
        return RankResult(**base, verdict=FAIL, message=collectives, collectives=collectives, stages=stages)
    noted = failing or next((st for st in stages if st.verdict == verdict and verdict != PASS), None)
    message = "" if noted is None else _stage_text(layout, noted)
    ratios = [st.worst_ratio for st in stages
              if st.worst_ratio is not None and st.verdict in (PASS, FAIL, KNOWN_DEVIATION)]
    return RankResult(**base, verdict=verdict, first_failing_stage=None if failing is None else failing.stage,
                      step=None if failing is None else step_of(failing.stage),
                      worst_ratio=max(ratios) if ratios else None, message=message, collectives=collectives,
                      stages=stages)


def _stage_text(layout: Layout, st: StageResult) -> str:
    """``step 2 of 4: ring_lse[1] fails — …`` (the step only for a ring stage)."""
    k = step_of(st.stage)
    step = "" if k is None else f"step {k + 1} of {layout.cp}: "
    verb = "fails" if st.verdict == FAIL else st.verdict
    return f"{step}{st.stage} {verb}" + (f" — {st.message}" if st.message else "")


def judge_ranks(golden: GoldenCase, layout: Layout, replies: Sequence[RankReply], judge: Judge, dtype: str,
                precision: str = "standard", promised: Mapping[str, int] | None = None
                ) -> tuple[str, list[StageResult], list[RankResult], str]:
    """(the case's verdict, its stages, the per-rank results, its message) for the replies of every rank.

    A rank that crashed or hung (``reply.error``), a missing reply or a rank's broken contract: ``error``,
    naming the rank.  Otherwise the deciding rank is the first failing one (then the first known deviation,
    the first uninformative one; all passing: the one with the largest ratio), whose stages are the case's
    and whose first failing stage (and ring step) its message names."""
    cfg = golden.spec.config
    by_rank = {r.rank: r for r in replies}
    missing = [r for r in range(layout.world) if r not in by_rank]
    if missing:
        return ERROR, [], [], f"{rank_label(layout, missing[0])}: no reply from the launcher"
    results: list[RankResult] = []
    for rank in range(layout.world):
        reply = by_rank[rank]
        label = rank_label(layout, rank)
        if reply.error:
            results.append(_rank_result(layout, rank, [], error=f"{label}: {reply.error}", issued=reply.issued))
            continue
        expected = rank_stage_names(layout, forward_stages(cfg))
        problem = contract_problem(reply.stages, dict.fromkeys(expected), label)
        if problem:
            results.append(_rank_result(layout, rank, [], error=problem, issued=reply.issued))
            continue
        stages = judge_rank(golden, layout, rank, reply.stages or {}, judge, dtype, precision)
        results.append(_rank_result(layout, rank, stages, collectives=collectives_problem(promised, reply.issued),
                                    issued=reply.issued))
    errored = next((r for r in results if r.verdict == ERROR), None)
    if errored is not None:
        return ERROR, [], results, errored.message
    verdict = next((v for v in (FAIL, KNOWN_DEVIATION, UNINFORMATIVE) if any(r.verdict == v for r in results)), PASS)
    if verdict == PASS:
        deciding = max(results, key=lambda r: -1.0 if r.worst_ratio is None else r.worst_ratio)
    else:
        deciding = next(r for r in results if r.verdict == verdict)
    stages = [dataclasses.replace(st, message=f"{where(layout, deciding.rank, st.stage)}: {st.message}")
              if st.message else st for st in deciding.stages]
    label = rank_label(layout, deciding.rank)
    joined = f"{label}, {deciding.message}" if deciding.step is not None else f"{label}: {deciding.message}"
    return verdict, stages, results, "" if verdict == PASS else joined


#: The pytest plugin's test of a layout's promised collectives (not a stage: every rank's counts).
COLLECTIVES = "collectives"


def plugin_stages(layout: Layout, collectives: bool) -> list[str]:
    """The pytest plugin's tests of a case × dtype for ``layout``: the rank stages of the spec's stages
    (:func:`rank_stage_names`), then :data:`COLLECTIVES` where the adapter promises collectives."""
    from ..spec import STAGES

    return list(rank_stage_names(layout, tuple(STAGES))) + ([COLLECTIVES] if collectives else [])


def stage_over_ranks(result: Any, stage: str) -> tuple[str, StageResult | None]:
    """(rank label, result) of ``stage`` over the ranks of ``result`` (a :class:`CaseResult` of a sharded run):
    the first rank where it fails, else a known deviation, else uninformative, else the first rank that
    judged it; ("", None) when no rank returned it."""
    found = [(r, st) for r in result.ranks for st in r.stages if st.stage == stage and st.verdict != NOT_EXPOSED]
    for verdict in (FAIL, KNOWN_DEVIATION, UNINFORMATIVE, PASS):
        for r, st in found:
            if st.verdict == verdict:
                label = f"rank {r.rank} of {r.world} (tp {r.tp}, cp {r.cp})"
                k = step_of(stage)
                return label + ("" if k is None else f", step {k + 1}"), dataclasses.replace(st)
    return "", None
