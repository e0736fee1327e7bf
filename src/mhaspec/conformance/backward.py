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
from ..spec import (BACKWARD_STAGES, INPUT_GRADIENT_STAGES, INPUT_GRADIENTS, STAGE, STAGES, compared_entries,
                    gradient_of)
from ..spec.stages import REGISTRY
from .compare import FAIL, NOT_EXPOSED, PASS, UNINFORMATIVE, StageResult, as_float_array, compare_stage, fold_local
from .tolerance import KAPPA, KAPPA_MIN_ELEMENTS, LAMBDA, Bound
from .tolerance import backward_bounds, local_checks

NO_BACKWARD = "the adapter has no backward(case) method"

SELF_ATTENTION_NOTE = (
    f"in a self-attention case {gradient_of('query')} is the gradient with respect to the one input tensor: "
    "the sum of the query, key and value gradients"
)
SHARED_KV_NOTE = (f"with key and value one tensor, {gradient_of('key')} is its gradient: the sum of the key and "
                  "value gradients")
#: What a gradient summing several inputs' gradients holds, by kind of case inputs (``CaseSpec.inputs``).
_SUM_NOTES = {"self": SELF_ATTENTION_NOTE, "shared_kv": SHARED_KV_NOTE}


#: Why a case lacks a backward stage it cannot have, by the stage's variant (spec/stages.py): a spec-1.1
#: stage it lacks is a projection bias's gradient (``config.bias`` False; the input gradients a case folds
#: are told apart above).
_ABSENT_BECAUSE = {None: "no projection biases", "rope": "no RoPE", "sinks": "no sinks", "bias": "no bias input"}


def case_backward_stages(golden: GoldenCase) -> list[str]:
    """The backward stages this case has, those its golden holds: no d_b_* without bias, no d_key/d_value in
    self-attention, the variants' gradients only with their variant (d_q_rot, d_k_rot with RoPE,
    d_sink_logits with sinks, d_bias with a bias input)."""
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
    gradients = INPUT_GRADIENTS[golden.spec.inputs]  # the input gradients this case has
    folded = [n for n in names if n in INPUT_GRADIENT_STAGES and n not in gradients]
    if folded and golden.spec.inputs == "self":
        return (f"backward() returned {', '.join(folded)} for self-attention case {golden.id}: "
                f"{SELF_ATTENTION_NOTE}, reported as {gradient_of('query')} alone")
    if folded:
        return (f"backward() returned {', '.join(folded)} for case {golden.id}, whose key and value are one tensor: "
                f"{SHARED_KV_NOTE}, reported as {gradient_of('key')} alone")
    absent = [n for n in names if n not in golden.stages]
    if absent:
        why = ", ".join(dict.fromkeys(_ABSENT_BECAUSE[REGISTRY[n].variant] for n in absent))
        return f"backward() returned {', '.join(absent)}, which case {golden.id} does not have ({why})"
    if not names:
        return "backward() returned no stage"
    return ""


def judge_backward(
    returned: Mapping[str, Any] | None,
    golden: GoldenCase,
    dtype: str,
    bounds: Mapping[str, Bound] | None = None,
    why_not: str = NO_BACKWARD,
    forward: Mapping[str, Any] | None = None,
    precision: str = "standard",
) -> list[StageResult]:
    """One verdict per backward stage of the case; ``returned`` None: every stage not exposed (``why_not``).

    ``bounds``: the backward bounds (default: :func:`backward_bounds` under ``precision``); under
    the standard contract each stage also has the forward's systematic-error test (the root mean
    square of its error over its noise bound, :data:`~mhaspec.conformance.tolerance.KAPPA`).
    Each stage is judged against the golden and, where the adapter returned
    what it is computed from (``forward``: the stages ``run`` returned), locally
    against the float64 recomputation from the adapter's own stages; either
    failing fails the stage.  A stage the golden check cannot resolve (a zero
    result would pass) is ``uninformative`` unless its local check passes.
    """
    names = case_backward_stages(golden)
    if returned is None:
        return [StageResult(s, NOT_EXPOSED, message=why_not) for s in names]
    if bounds is None:
        bounds = backward_bounds(golden, dtype, precision=precision)
    checks = local_checks(golden, dtype, own_stages(golden, forward or {}, returned), precision=precision)
    out = []
    for stage in names:
        if stage not in returned:
            out.append(StageResult(stage, NOT_EXPOSED))
            continue
        visible = compared_entries(stage, golden.visible)  # masked dP is not compared
        res = _resolved(judge_stage(stage, returned[stage], golden, bounds[stage], dtype, precision, visible),
                        golden, bounds[stage].tolerance(LAMBDA))
        local = checks.get(stage)
        if local is not None:
            lres = compare_stage(stage, returned[stage], local[0], local[1], dtype, visible, value_checks=False)
            fold_local(res, _resolved(lres, golden, local[1]), local[2])
        if res.verdict == FAIL and not res.failed_check:
            res.failed_check = "golden"
        if res.verdict == FAIL and len(INPUT_GRADIENTS[golden.spec.inputs].get(stage, "")) > 1:  # a sum of gradients
            res.message += f" ({_SUM_NOTES[golden.spec.inputs]})"
        out.append(res)
    return out


def judge_stage(stage: str, got: Any, golden: GoldenCase, bound: Bound, dtype: str, precision: str,
                visible: np.ndarray | None) -> StageResult:
    """One backward stage against the golden: element-wise, and (standard contract) the
    systematic-error test on the noise part of its bound, as in the forward."""
    rms_limit = KAPPA**0.5 if precision == "standard" else None
    return compare_stage(stage, got, golden.stages[stage], bound.tolerance(LAMBDA), dtype, visible,
                         noise=bound, rms_limit=rms_limit, rms_min_elements=KAPPA_MIN_ELEMENTS)


def _resolved(res: StageResult, golden: GoldenCase, tolerance: np.ndarray) -> StageResult:
    """``d_b_k`` is exactly 0 in a spec-1.1 case (a key bias shifts a whole score row, which softmax ignores;
    with RoPE, softcap or a sink it does not, and d_b_k is small), so a zero result may "pass": it is
    informative when it would catch the column sums of |d_k_proj| that a bug in the reduction leaves."""
    if res.stage == STAGE.d_b_k and res.verdict == UNINFORMATIVE:
        if np.any(np.abs(golden.stages[STAGE.d_k_proj]).sum(axis=(0, 1)) > tolerance):
            res.verdict, res.message = PASS, ""
    return res


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
