"""Memory-bounded judging: a large case is judged one block of query rows at a time.

Every stage but ``k_proj``/``v_proj`` has a query-row axis, and row t of each
stage depends only on row t of the previous stages (and on all of K and V), so
the element-wise tolerances of a block of rows are the tolerances of those
rows in the whole case: judging by blocks gives the same verdicts as judging
at once, in O(rows · H · S) memory instead of O(B · H · T · S).  The blocks'
stage results are merged into one per stage: the worst verdict (fail, then
known deviation, then any other non-pass verdict such as uninformative, then
pass), the largest errors, the worst element's index in the whole case, and
the systematic-error test's root mean square over all blocks (each block must
also pass it on its own, which a correct implementation does: its rounding
noise has that mean square in every block).

Only cases above :data:`MAX_BLOCK_ELEMENTS` per (B, H, T, S) stage are split;
every committed fixture is judged in one block.  A block of a causal (or windowed)
case is judged over the keys its rows see: the chunk loops of its bounds and local
checks and the second opinion's plain implementations stop at the last one
(:func:`~mhaspec.spec.masks.seen_keys`), which changes only the order of
the judge's own roundings (tests/test_kernels.py), as the fast reference's golden does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..fixtures import GoldenCase, StageErrors
from ..spec import REGISTRY
from ..spec.case import input_rows
from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, PASS, StageResult
from .engine.chunks import one_blas_thread
from .judging import judging_block
from .second_opinion import SecondOpinion

#: Largest (B, H, T, S) block judged at once: 2^22 float64 elements = 32 MiB per array.
MAX_BLOCK_ELEMENTS = 1 << 22

#: Axis of the query rows (T) in each forward stage (the variants' q_rot, k_rot and lse too); None: the
#: stage has none (key/value projections).
ROW_AXIS = {name: stage.rows for name, stage in REGISTRY.items() if stage.direction == "forward"}


def _blocks(golden: GoldenCase, max_elements: int) -> list[tuple[int, int, int]]:
    """(batch entry, first row, end row) of each block; [] when the case fits in one block."""
    B, H, T, S = golden.visible.shape
    rows = getattr(golden, "block_rows", 0)  # a case made one block at a time (fixtures.RowBlocks): its blocks
    if not rows and B * H * T * S <= max_elements:
        return []
    rows = rows or max(1, max_elements // (H * S))
    return [(b, t0, min(T, t0 + rows)) for b in range(B) for t0 in range(0, T, rows)]


def stage_shape(golden: GoldenCase, stage: str) -> tuple[int, ...]:
    """The shape of ``golden``'s stage, without computing it where the golden is made one block at a
    time (fixtures.RowBlocks, whose :class:`~mhaspec.fixtures.LazyStages` compute the whole stage when read)."""
    shape_of = getattr(golden.stages, "shape_of", None)
    return tuple(golden.stages[stage].shape if shape_of is None else shape_of(stage))


def _slice_stage(stage: str, x: Any, b: int, t0: int, t1: int) -> Any:
    if isinstance(x, float):
        return x
    axis = ROW_AXIS[stage]
    index: list[Any] = [slice(b, b + 1)]
    if axis is not None:
        index += [slice(None)] * (axis - 1) + [slice(t0, t1)]
    return x[tuple(index)]


def block_case(golden: GoldenCase, b: int, t0: int, t1: int) -> GoldenCase:
    """The golden rows [t0, t1) of batch entry ``b``, as a case of its own (B = 1, T = t1 - t0)."""
    if hasattr(golden, "block"):  # made one block at a time (fixtures.RowBlocks): never held whole
        return golden.block(b, t0, t1)
    error = golden.reference_error
    return GoldenCase(
        spec=golden.spec.model_copy(update={"batch": 1, "tgt_len": t1 - t0}),
        inputs={k: input_rows(k, v, b, t0, t1) for k, v in golden.inputs.items()},
        weights=golden.weights,
        stages={k: _slice_stage(k, v, b, t0, t1) for k, v in golden.stages.items() if k in ROW_AXIS},  # forward
        visible=golden.visible[b : b + 1, :, t0:t1],
        path=golden.path,
        reference_error=None if error is None else StageErrors(
            {k: _slice_stage(k, v, b, t0, t1) for k, v in error.items()}),
        row_offset=golden.row_offset + t0,
        case_tgt_len=golden.whole_tgt_len,
    )


def _rank(verdict: str) -> int:
    return {FAIL: 0, KNOWN_DEVIATION: 1, PASS: 3}.get(verdict, 2)


def merge(parts: list[tuple[tuple[int, int, int], StageResult]]) -> StageResult:
    """One stage's results over its blocks ((b, t0, t1), result) -> one result for the whole case."""
    first = parts[0][1]
    if first.verdict == NOT_EXPOSED:
        return first
    worst_verdict = min((r.verdict for _, r in parts), key=_rank)
    merged = StageResult(first.stage, worst_verdict)
    merged.compared = sum(r.compared for _, r in parts)
    merged.nonfinite = sum(r.nonfinite for _, r in parts)
    for attr in ("max_abs_err", "max_rel_err"):
        values = [getattr(r, attr) for _, r in parts if getattr(r, attr) is not None]
        setattr(merged, attr, max(values) if values else None)
    locals_ = [r.local_worst_ratio for _, r in parts if r.local_worst_ratio is not None]
    merged.local_worst_ratio = max(locals_) if locals_ else None
    rms = [(r.compared, r.rms_ratio) for _, r in parts if r.rms_ratio is not None and r.compared]
    if rms:  # the mean square over the blocks, weighted by their compared elements
        merged.rms_ratio = float(np.sqrt(sum(n * x * x for n, x in rms) / sum(n for n, _ in rms)))
    merged.second_opinion = SecondOpinion.merged(r.second_opinion for _, r in parts if r.second_opinion is not None)
    failing = [r for _, r in parts if r.verdict == FAIL]
    if failing:
        checks = {c for r in failing for c in r.failed_check.split("+") if c}
        merged.failed_check = "+".join(c for c in ("golden", "local") if c in checks)
        merged.imprecise = all(r.imprecise for r in failing)  # one plainly failing block: a plain failure
    rated = [(where, r) for where, r in parts if r.worst_ratio is not None]
    if rated:
        (b, t0, t1), worst = max(rated, key=lambda item: item[1].worst_ratio)
        merged.worst_ratio = worst.worst_ratio
        if worst.worst_index is not None:
            index = list(worst.worst_index)
            index[0] += b
            axis = ROW_AXIS[first.stage]
            if axis is not None:
                index[axis] += t0
            merged.worst_index = tuple(index)
    # the message and reason of the first block with the merged verdict, located in the case
    (b, t0, t1), chosen = next((where, r) for where, r in parts if r.verdict == worst_verdict)
    merged.reason = chosen.reason
    if worst_verdict == KNOWN_DEVIATION:  # a bounded declaration's figures: the worst block's
        merged.within = chosen.within
        within = [r.within_ratio for _, r in parts if r.within_ratio is not None]
        merged.within_ratio = max(within) if within else None
    if chosen.message:
        where = f"batch entry {b}" if ROW_AXIS[first.stage] is None else f"batch entry {b}, query rows {t0}:{t1}"
        merged.message = f"[block: {where}; indices within the block] {chosen.message}"
    return merged


def judge_in_blocks(
    golden: GoldenCase,
    returned: Mapping[str, Any],
    judge: Callable[[GoldenCase, Mapping[str, Any]], list[StageResult]],
    max_elements: int | None = None,
) -> list[StageResult]:
    """``judge(golden, returned)``, block by block when the case is large (default: above
    :data:`MAX_BLOCK_ELEMENTS`)."""
    blocks = _blocks(golden, MAX_BLOCK_ELEMENTS if max_elements is None else max_elements)
    if not blocks:
        return judge(golden, returned)
    arrays: dict[str, Any] = {}
    for stage, value in returned.items():
        try:
            array = np.asarray(value)
        except Exception:
            return judge(golden, returned)  # not an array: judged whole, where it fails with the reason
        if array.shape != stage_shape(golden, stage):
            return judge(golden, returned)  # a wrong shape fails whole, with the shapes in the message
        arrays[stage] = array
    per_stage: dict[str, list[tuple[tuple[int, int, int], StageResult]]] = {}
    memos: dict[int, dict[Any, Any]] = {}  # of the batch entry being judged: its keys' and values' side
    # (judging.memoised: what every block of the entry shares)
    with one_blas_thread():  # a block's products are small: a threaded BLAS spends more CPU than it saves
        for b, t0, t1 in blocks:
            if b not in memos:
                memos = {b: {}}
            sub = {stage: _slice_stage(stage, a, b, t0, t1) for stage, a in arrays.items()}
            # key/value projections: judged once per batch entry, in its first block
            with judging_block(block_case(golden, b, t0, t1), golden, memos[b], key_stages=t0 == 0) as block:
                results = judge(block, sub)
            for res in results:
                if ROW_AXIS[res.stage] is None and t0 > 0:
                    continue  # (not judged in this block: judging.judges_key_stages)
                per_stage.setdefault(res.stage, []).append(((b, t0, t1), res))
    return [merge(parts) for parts in per_stage.values()]
