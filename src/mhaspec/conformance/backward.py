"""Judging an adapter's backward stages (``mhaspec run ADAPTER --backward``).

An adapter opts in with ``backward(case) -> {stage: array}``; ``case.d_output``
is the upstream gradient.  The runner calls it after ``run(case)`` and judges
the returned stages here, in :data:`mhaspec.spec.BACKWARD_STAGES` order, after
the forward stages — so the first failing stage of a case may be a backward
stage.  The contract is in docs/backward.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import BACKWARD_STAGES, FOLDED_IN_SELF_ATTENTION, STAGES
from .compare import FAIL, NOT_EXPOSED, PASS, StageResult, as_float_array, compare_stage
from .tolerance_backward import backward_tolerances, local_checks

NO_BACKWARD = "the adapter has no backward(case) method"

#: A backward stage that passes only because its bound is too wide to resolve a bug in this
#: dtype (DESIGN.md §8: never counted as a pass).
UNINFORMATIVE = "uninformative"

#: A check resolves a stage when returning all zeros would fail at least this share of the
#: elements whose expected value is nonzero.
RESOLVING_SHARE = 0.5

SELF_ATTENTION_NOTE = (
    "in a self-attention case d_query is the gradient with respect to the one input tensor: "
    "the sum of the query, key and value gradients"
)


def case_backward_stages(golden: GoldenCase) -> list[str]:
    """The backward stages this case has (no d_b_* without bias; no d_key/d_value in self-attention)."""
    return [s for s in BACKWARD_STAGES if s in golden.stages]


def contract_error(returned: Any, golden: GoldenCase) -> str:
    """Why ``returned`` breaks the backward contract ("" when it does not)."""
    if not isinstance(returned, Mapping):
        return f"backward() returned {type(returned).__name__}, expected a mapping of stage name to array"
    names = [str(k) for k in returned]
    forward = [n for n in names if n in STAGES]
    if forward:
        return f"backward() returned forward stage(s) {', '.join(forward)}; return them from run()"
    unknown = [n for n in names if n not in BACKWARD_STAGES]
    if unknown:
        return f"backward() returned unknown stage(s) {', '.join(unknown)}; backward stages are {', '.join(BACKWARD_STAGES)}"
    if golden.spec.inputs == "self":
        folded = [n for n in names if n in FOLDED_IN_SELF_ATTENTION]
        if folded:
            return (f"backward() returned {', '.join(folded)} for self-attention case {golden.id}: "
                    f"{SELF_ATTENTION_NOTE}, reported as d_query alone")
    absent = [n for n in names if n not in golden.stages]
    if absent:
        return f"backward() returned {', '.join(absent)}, which case {golden.id} does not have (no bias)"
    if not names:
        return "backward() returned no stage"
    return ""


def judge_backward(
    returned: Mapping[str, Any] | None,
    golden: GoldenCase,
    dtype: str,
    tolerances: dict[str, np.ndarray] | None = None,
    why_not: str = NO_BACKWARD,
    forward: Mapping[str, Any] | None = None,
) -> list[StageResult]:
    """One verdict per backward stage of the case; ``returned`` None: every stage not exposed (``why_not``).

    ``tolerances``: the backward bounds (default: :func:`backward_tolerances`).
    Each stage is judged against the golden and, where the adapter returned
    what it is computed from (``forward``: the stages ``run`` returned), locally
    against the float64 recomputation from the adapter's own stages; either
    failing fails the stage.
    """
    names = case_backward_stages(golden)
    if returned is None:
        return [StageResult(s, NOT_EXPOSED, message=why_not) for s in names]
    if tolerances is None:
        tolerances = backward_tolerances(golden, dtype)
    checks = local_checks(golden, dtype, own_stages(golden, forward or {}, returned))
    out = []
    for stage in names:
        if stage not in returned:
            out.append(StageResult(stage, NOT_EXPOSED))
            continue
        visible = golden.visible if stage == "d_attn_weights" else None  # masked dP is not compared
        res = compare_stage(stage, returned[stage], golden.stages[stage], tolerances[stage], dtype, visible)
        local = checks.get(stage)
        if local is not None:
            _merge_local(res, compare_stage(stage, returned[stage], local[0], local[1], dtype, visible), local[2])
        # d_b_k is exactly 0 (a key bias shifts a whole score row, which softmax ignores): resolving
        # means catching the column sums of d_k_proj that a bug would leave.
        target = (np.abs(golden.stages["d_k_proj"]).sum(axis=(0, 1)) if stage == "d_b_k" else golden.stages[stage])
        resolves = resolves_bugs(target, tolerances[stage], visible)
        if local is not None:
            resolves = resolves or resolves_bugs(target if stage == "d_b_k" else local[0], local[1], visible)
        if res.verdict == PASS and not resolves:
            res.verdict = UNINFORMATIVE
            res.message = (f"within the bound, but in {dtype} the bound is wider than most expected values "
                           "(all zeros would pass): cannot tell a bug from rounding; expose the stages it is "
                           "computed from for a sharp local check")
        if res.verdict == FAIL and stage == "d_query" and golden.spec.inputs == "self":
            res.message += f" ({SELF_ATTENTION_NOTE})"
        out.append(res)
    return out


def own_stages(golden: GoldenCase, *returned: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The adapter's returned stages as float64 arrays, those with the canonical shape and finite values only."""
    out = {}
    for mapping in returned:
        for name, value in mapping.items():
            ref = golden.stages.get(name)
            arr, _ = as_float_array(value)
            if ref is not None and arr is not None and arr.shape == ref.shape and np.isfinite(arr).all():
                out[name] = arr
    return out


def _merge_local(res: StageResult, local: StageResult, sources: tuple[str, ...]) -> None:
    """Fold the local check into the golden verdict: the stage fails if either fails."""
    if local.verdict == FAIL and res.verdict == PASS:
        res.verdict = FAIL
        res.message = (f"local check against the float64 recomputation from the adapter's own "
                       f"{', '.join(sources)}: {local.message}")
        res.worst_ratio, res.worst_index = local.worst_ratio, local.worst_index
    elif res.verdict == PASS and local.worst_ratio is not None and (res.worst_ratio or 0) < local.worst_ratio:
        res.worst_ratio, res.worst_index = local.worst_ratio, local.worst_index


def resolves_bugs(expected: np.ndarray, tolerance: np.ndarray, visible: np.ndarray | None = None) -> bool:
    """Whether a check with this element-wise ``tolerance`` can tell a wrong result from rounding:
    all zeros must fail at :data:`RESOLVING_SHARE` or more of the elements that should be nonzero."""
    sel = np.ones(expected.shape, dtype=bool) if visible is None else np.broadcast_to(visible, expected.shape)
    nonzero = sel & (expected != 0)
    if not nonzero.any():
        return True  # nothing but zeros is expected: any nonzero value beyond the floor fails
    return bool(np.mean(np.abs(expected[nonzero]) > tolerance[nonzero]) >= RESOLVING_SHARE)
