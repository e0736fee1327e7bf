"""Judging a packed case (``seq_lens``, docs/serving.md "Packed sequences"): each sequence against its own
full pass.

Batch entry b is one sequence of l_b tokens; its padding rows and keys ≥ l_b are not compared.  What
``run(case)`` returned, in the canonical padded layout (B, T, ·), is cut to each sequence's rows and keys
[0, l_b) (:func:`sequence_mapping`) and judged like a call of a schedule (conformance/decode.py) of l_b rows
against a cache of l_b keys, on entry b only: the golden's :func:`~mhaspec.conformance.decode.call_view`
of entry b with t0 = 0, t1 = L_c = l_b — a case of its own (l_b rows, l_b keys), so the tolerance model is
unchanged.  The verdict names the first failing sequence: ``sequence 2 of 4 (length 37): scores fail — …``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import REGISTRY
from ..spec.packed import sequence_calls
from .compare import StageResult
from .decode import expected_shapes, judge_calls
from .report import CallResult

#: Why an adapter is not judged on a packed case when it does not declare ``packed = True``.
NOT_PACKED = ("the adapter does not declare packed = True: a packed case (seq_lens) hands run(case) NaN in every "
              "padding row (docs/serving.md)")


def _first(x: np.ndarray, axis: int | None, n: int) -> np.ndarray:
    """``x`` cut to [0, n) on ``axis`` (unchanged when None)."""
    return x if axis is None else x[(slice(None),) * axis + (slice(0, n),)]


def sequence_mapping(returned: Mapping[str, Any], full: Mapping[str, tuple[int, ...]], length: int) -> dict[str, Any]:
    """What ``run(case)`` returned cut to the first ``length`` rows and keys of every batch entry: query rows
    (its row axis), key rows (``k_proj``, ``k_rot``, ``v_proj``) and the key axis of score-like stages.  A
    stage not of its padded shape ``full[stage]`` is passed as it is (it fails on its shape)."""
    out: dict[str, Any] = {}
    for stage, value in returned.items():
        try:
            array = np.asarray(value)
        except Exception:  # not an array: judged as it is, where it fails with the reason
            array = None
        if array is None or array.shape != full[stage]:
            out[stage] = value
            continue
        spec = REGISTRY[stage]
        out[stage] = _first(_first(array, spec.rows, length), spec.keys, length)
    return out


def judge_sequences(golden: GoldenCase, returned: Mapping[str, Any],
                    judge: Callable[[GoldenCase, Mapping[str, Any]], list[StageResult]]
                    ) -> tuple[str, list[StageResult], list[CallResult], str]:
    """(the case's verdict, its stages, one result per sequence, its message) for what ``run(case)`` of a
    packed case returned (already a mapping with ``output`` and known stages):
    :func:`~mhaspec.conformance.decode.judge_calls` with one "call" per sequence, entry b only."""
    seq_lens = golden.spec.seq_lens
    assert seq_lens is not None
    spec = golden.spec
    calls = sequence_calls(seq_lens)
    full = expected_shapes(golden, calls[0]._replace(t1=spec.tgt_len, cache=spec.src_len))  # (B, T, ·): padded
    mappings = [sequence_mapping(returned, full, n) for n in seq_lens]
    return judge_calls(golden, calls, mappings, judge, entries=[(b,) for b in range(len(seq_lens))])
