"""Judging a case with a schedule: each call of the adapter's ``decode(case)`` against its own KV cache
(docs/serving.md).

Call c covers query rows [t0, t1) and leaves key rows [0, L_c) in the cache.  Causality aligned
bottom-right hides every key ≥ L_c from the call's rows, so the call's expected values are rows
[t0, t1) of the full pass restricted to keys [0, L_c): the golden's :func:`call_view`, a block of
query rows (:func:`mhaspec.conformance.blocks.block_case`) of the case cut to its first L_c keys —
itself a case of its own, the first t1 rows against the first L_c keys, so that every rule anchored on
the diagonal (bottom-right offset P = S − T, windows, ALiBi, RoPE positions) is the case's.  Its
query-row stages are the call's rows; its key-side stages (``k_proj``, ``k_rot``, ``v_proj``) are the
whole cache after the call.

Each call is judged like a block of rows (:func:`judge_calls`): the same judging (golden and local
checks, second opinion) on that view, one batch entry at a time, merged per call
(:func:`mhaspec.conformance.blocks.merge`); the case's verdict is its first failing call's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..fixtures import GoldenCase, StageErrors
from ..spec import REGISTRY, STAGE
from ..spec.schedule import Call, call_label
from ..spec.stages import forward_stages
from . import second_opinion
from .blocks import MAX_BLOCK_ELEMENTS, ROW_AXIS, _slice_stage, block_case, merge
from .judging import judging_block
from .compare import FAIL, KNOWN_DEVIATION, NOT_EXPOSED, PASS, UNINFORMATIVE, StageResult
from .report import CallResult

#: Why an adapter is not judged on a case with a schedule when it has no ``decode``.
NO_DECODE = "the adapter has no decode(case) method (docs/serving.md)"


def _first_keys(stage: str, x: Any, cache: int) -> Any:
    """``x`` (a stage of a block of rows, or its error bound) cut to keys [0, ``cache``) on its key axis."""
    axis = REGISTRY[stage].keys
    if isinstance(x, float) or axis is None:
        return x
    return x[(slice(None),) * axis + (slice(0, cache),)]


def _input_keys(name: str, x: np.ndarray, cache: int) -> np.ndarray:
    """Input ``name`` of a block of rows cut to keys [0, ``cache``): rows of key and value, the last
    axis of the mask and the additive bias (B|1, H|1, T|1, S); the query unchanged."""
    if name in ("key", "value"):
        return x[:, :cache]
    if name in ("mask", "bias"):
        return x[..., :cache]
    return x


def golden_rows(golden: GoldenCase, b: int, t0: int, t1: int, last: dict[Any, GoldenCase] | None = None) -> GoldenCase:
    """Batch entry b's golden rows [t0, t1), every key (:func:`block_case`).

    A case made one block of rows at a time (fixtures.RowBlocks) computes the blocks of ``block_rows``
    rows around [t0, t1) — the blocks judge_in_blocks would, so the same numbers to the bit — and keeps
    the call's rows: memory in the call's rows, never the whole case.  ``last`` keeps each batch entry's last block
    computed, which the next decode steps share."""
    if not hasattr(golden, "block"):
        return block_case(golden, b, t0, t1)
    rows, T = golden.block_rows, golden.spec.tgt_len  # type: ignore[attr-defined]
    start, end = t0 - t0 % rows, min(T, t1 + (-t1) % rows)
    key = (b, start, end)
    if last is None or key not in last:
        block = golden.block(b, start, end)  # type: ignore[attr-defined]
        if last is None:
            return block_case(block, 0, t0 - start, t1 - start)
        for old in [k for k in last if k[0] == b]:  # one block per batch entry
            del last[old]
        last[key] = block
    return block_case(last[key], 0, t0 - start, t1 - start)


def call_view(golden: GoldenCase, b: int, call: Call, last: dict[Any, GoldenCase] | None = None,
              rows: tuple[int, int] | None = None) -> GoldenCase:
    """What call ``call`` of batch entry b is judged against: golden rows [t0, t1) with ``row_offset`` t0,
    keys [0, L_c) — a case of t1 rows against L_c = P + t1 keys (so its bottom-right diagonal is the
    case's), of which these are the last rows.  ``rows``: only the call's rows [r0, r1) (a large call is
    judged in blocks of rows, :func:`row_chunks`), with ``row_offset`` r0."""
    r0, r1 = rows or (call.t0, call.t1)
    rows = golden_rows(golden, b, r0, r1, last)
    error = rows.reference_error
    return dataclasses.replace(
        rows,
        spec=rows.spec.model_copy(update={"src_len": call.cache, "schedule": None, "seq_lens": None}),
        inputs={k: _input_keys(k, v, call.cache) for k, v in rows.inputs.items()},
        stages={k: _first_keys(k, v, call.cache) for k, v in rows.stages.items()},
        visible=rows.visible[..., : call.cache],
        reference_error=None if error is None else StageErrors(
            {k: _first_keys(k, v, call.cache) for k, v in error.items()}),
        sha256=None,
        case_tgt_len=call.t1,
        _cases={},
    )


def expected_shapes(golden: GoldenCase, call: Call) -> dict[str, tuple[int, ...]]:
    """Each forward stage's shape in a call's mapping: (B, n_c, ·) for the query rows, (B, H, n_c, L_c)
    for scores and weights, (B, L_c, ·) for the cache's keys and values."""
    cfg, B = golden.spec.config, golden.spec.batch
    shapes = {**cfg.stage_shapes(B, call.rows, call.cache), **cfg.variant_stage_shapes(B, call.rows, call.cache)}
    return {name: tuple(shapes[name]) for name in forward_stages(cfg)}


def contract_error(returned: Any, golden: GoldenCase, calls: Sequence[Call]) -> str:
    """Why what ``decode(case)`` returned cannot be judged ("" when it can): not a list of one mapping of
    stage name to array per call, a stage this case does not have, or no ``output``; each error names
    the call."""
    n = len(calls)
    if isinstance(returned, Mapping) or not isinstance(returned, Sequence):
        return (f"decode() returned {type(returned).__name__}, expected a list of {n} mappings of stage name to "
                f"array, one per call of the schedule (case.calls())")
    if len(returned) != n:
        return f"decode() returned {len(returned)} mapping(s), the schedule has {n} calls (case.calls())"
    known = forward_stages(golden.spec.config)
    for c, (call, mapping) in enumerate(zip(calls, returned)):
        label = call_label(c, call, n)
        if not isinstance(mapping, Mapping):
            return f"decode(): {label}: {type(mapping).__name__}, expected a mapping of stage name to array"
        unknown = [str(k) for k in mapping if k not in known]
        if unknown:
            return (f"decode(): {label}: unknown stage(s) {', '.join(unknown)}; stages of this case are "
                    f"{', '.join(known)}")
        if STAGE.output not in mapping:
            return f"decode(): {label}: the required stage {STAGE.output!r} is missing"
    return ""


def _shape_failures(returned: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], call: Call
                    ) -> tuple[dict[str, Any], dict[str, StageResult]]:
    """(the call's stages of the expected shape, a failure for each stage of another shape)."""
    arrays: dict[str, Any] = {}
    failed: dict[str, StageResult] = {}
    for stage, value in returned.items():
        try:
            array = np.asarray(value)
        except Exception:  # not an array: judged as it is, where it fails with the reason
            arrays[stage] = value
            continue
        if array.shape == expected[stage]:
            arrays[stage] = array
            continue
        axes = ", ".join(REGISTRY[stage].axes).replace("T", "n_c").replace("S", "L_c")
        where = (f"the sequence's l_b = {call.rows} rows and keys of the padded layout" if call.kind == "sequence" else
                 f"n_c = {call.rows} rows, cache L_c = {call.cache} keys after the call")
        failed[stage] = StageResult(stage, FAIL, message=(
            f"shape {array.shape}, expected ({axes}) = {expected[stage]} ({where})"), failed_check="golden")
    return arrays, failed


def verdict_of(stages: Sequence[StageResult]) -> str:
    """The verdict of a set of stage results: fail, then known deviation, then uninformative where the
    required ``output`` could not be judged, else pass."""
    verdicts = {st.verdict for st in stages}
    if FAIL in verdicts:
        return FAIL
    if KNOWN_DEVIATION in verdicts:
        return KNOWN_DEVIATION
    output = next((st for st in stages if st.stage == STAGE.output), None)
    if output is not None and output.verdict == UNINFORMATIVE:
        return UNINFORMATIVE  # the required stage could not be judged: never a pass
    return PASS


def row_chunks(golden: GoldenCase, call: Call, max_elements: int | None = None) -> list[tuple[int, int]]:
    """The blocks of rows [r0, r1) a call is judged in: the golden's own blocks (fixtures.RowBlocks: at
    multiples of its ``block_rows``), else at most ``max_elements`` (default :data:`MAX_BLOCK_ELEMENTS`)
    (H, rows, L_c) elements each — one block for every call of a small case, so memory stays bounded for
    a long chunk too."""
    max_elements = MAX_BLOCK_ELEMENTS if max_elements is None else max_elements
    size = getattr(golden, "block_rows", 0)
    if size:
        return [(max(call.t0, a), min(call.t1, a + size)) for a in range(call.t0 - call.t0 % size, call.t1, size)]
    size = max(1, max_elements // (golden.spec.config.H * call.cache))
    return [(r, min(call.t1, r + size)) for r in range(call.t0, call.t1, size)]


def judge_call(golden: GoldenCase, call: Call, returned: Mapping[str, Any],
               judge: Callable[[GoldenCase, Mapping[str, Any]], list[StageResult]],
               last: dict[Any, GoldenCase] | None = None, entries: Sequence[int] | None = None) -> list[StageResult]:
    """One call's stage results: each batch entry's view (block by block of rows, :func:`row_chunks`)
    judged by ``judge``, merged in pipeline order (``last``: :func:`golden_rows`'s).  The key side (the
    cache) is judged in the first block of each batch entry, its bounds shared by the others.  ``entries``:
    the batch entries judged (default every one; a packed case's sequence: its own, conformance/packed.py)."""
    arrays, failed = _shape_failures(returned, expected_shapes(golden, call), call)
    per_stage: dict[str, list[tuple[tuple[int, int, int], StageResult]]] = {}
    chunks = row_chunks(golden, call)
    for b in range(golden.spec.batch) if entries is None else entries:
        memo: dict[Any, Any] = {}  # what the blocks of this batch entry share (judging.memoised)
        for r0, r1 in chunks:
            view = call_view(golden, b, call, last, (r0, r1))
            sub = {stage: _slice_stage(stage, a, b, r0 - call.t0, r1 - call.t0) if isinstance(a, np.ndarray) else a
                   for stage, a in arrays.items()}  # (a value that is not an array: judged as it is, and fails)
            with judging_block(view, view, memo, key_stages=r0 == call.t0) as block:
                results = judge(block, sub)
            for res in results:
                if ROW_AXIS[res.stage] is None and r0 > call.t0:
                    continue  # (judged in the entry's first block)
                per_stage.setdefault(res.stage, []).append(((b, r0, r1), res))
    merged = {stage: merge(parts) for stage, parts in per_stage.items()}
    for stage, res in failed.items():
        merged[stage] = res  # judged NOT_EXPOSED (not passed on): the shape is its failure
    out = [merged[s] for s in forward_stages(golden.spec.config) if s in merged]
    for st in out:  # the second opinion, on the call's sums (batch entries merged)
        second_opinion.fold(st)
    return out


def _call_result(c: int, call: Call, of: int, stages: list[StageResult]) -> CallResult:
    verdict = verdict_of(stages)
    failing = next((st for st in stages if st.verdict == FAIL), None)
    noted = failing or next((st for st in stages if st.verdict == verdict and verdict != PASS), None)
    message = "" if noted is None else f"{noted.stage} {noted.verdict}" + (f" — {noted.message}" if noted.message else "")
    ratios = [st.worst_ratio for st in stages if st.worst_ratio is not None and st.verdict in (PASS, FAIL, KNOWN_DEVIATION)]
    return CallResult(call=c + 1, of=of, kind=call.kind, rows=(call.t0, call.t1), cache=call.cache, verdict=verdict,
                      first_failing_stage=None if failing is None else failing.stage,
                      worst_ratio=max(ratios) if ratios else None, message=message, stages=stages)


def _over_calls(results: Sequence[CallResult]) -> list[StageResult]:
    """Each stage merged over every call that exposed it (indices already the case's), the second opinion
    folded on the sums of all calls: a bias too small for any one call's sums."""
    per_stage: dict[str, list[tuple[tuple[int, int, int], StageResult]]] = {}
    for r in results:
        for st in r.stages:
            per_stage.setdefault(st.stage, []).append(((0, 0, 0), st))
    out = []
    for parts in per_stage.values():
        exposed = [part for part in parts if part[1].verdict != NOT_EXPOSED] or parts[:1]
        merged = merge(exposed)
        if merged is not exposed[0][1]:
            merged.message = next((r.message for _, r in exposed if r.verdict == merged.verdict), "")  # one prefix
            second_opinion.fold(merged)
        out.append(merged)
    return out


def judge_calls(golden: GoldenCase, calls: Sequence[Call], returned: Sequence[Mapping[str, Any]],
                judge: Callable[[GoldenCase, Mapping[str, Any]], list[StageResult]],
                entries: Sequence[Sequence[int]] | None = None,
                ) -> tuple[str, list[StageResult], list[CallResult], str]:
    """(the case's verdict, its stages, the per-call results, its message) for what ``decode(case)``
    returned (already through :func:`contract_error`).

    The case's verdict and stages are those of its first call with the worst verdict (the first failing
    call, else the first known deviation, else the first uninformative one), each message led by the call
    (``call 3 of 7 (decode, cache 8): …``).  A case whose calls all pass has every call's stages merged,
    with the second opinion on the sums of all calls (which may still fail it, naming no call).  ``entries``:
    the batch entries each call judges (default every one; a packed case: sequence b, entry b only)."""
    last: dict[Any, GoldenCase] = {}  # the golden's last block of rows (a case made one block at a time)
    results = [_call_result(c, call, len(calls),
                            judge_call(golden, call, mapping, judge, last, None if entries is None else entries[c]))
               for c, (call, mapping) in enumerate(zip(calls, returned))]
    verdict = next((v for v in (FAIL, KNOWN_DEVIATION, UNINFORMATIVE) if any(r.verdict == v for r in results)), PASS)
    if verdict == PASS:
        stages = _over_calls(results)
        verdict = verdict_of(stages)
        failing = next((st for st in stages if st.verdict == FAIL), None)
        noun = "sequence" if calls and calls[0].kind == "sequence" else "call"
        return verdict, stages, results, "" if failing is None else \
            f"every {noun} within its tolerances; over all {len(calls)} {noun}s: {failing.stage} fails — {failing.message}"
    deciding = next(r for r in results if r.verdict == verdict)
    label = call_label(deciding.call - 1, calls[deciding.call - 1], len(calls))
    stages = [dataclasses.replace(st, message=f"{label}: {st.message}") if st.message else st for st in deciding.stages]
    return verdict, stages, results, f"{label}: {deciding.message}"
