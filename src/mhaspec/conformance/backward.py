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
from .compare import FAIL, NOT_EXPOSED, StageResult, compare_stage
from .tolerance_backward import backward_tolerances

NO_BACKWARD = "the adapter has no backward(case) method"

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
) -> list[StageResult]:
    """One verdict per backward stage of the case; ``returned`` None: every stage not exposed (``why_not``).

    ``tolerances``: the backward bounds (default: :func:`backward_tolerances`).
    """
    names = case_backward_stages(golden)
    if returned is None:
        return [StageResult(s, NOT_EXPOSED, message=why_not) for s in names]
    if tolerances is None:
        tolerances = backward_tolerances(golden, dtype)
    out = []
    for stage in names:
        if stage not in returned:
            out.append(StageResult(stage, NOT_EXPOSED))
            continue
        visible = golden.visible if stage == "d_attn_weights" else None  # masked dP is not compared
        res = compare_stage(stage, returned[stage], golden.stages[stage], tolerances[stage], dtype, visible)
        if res.verdict == FAIL and stage == "d_query" and golden.spec.inputs == "self":
            res.message += f" ({SELF_ATTENTION_NOTE})"
        out.append(res)
    return out
