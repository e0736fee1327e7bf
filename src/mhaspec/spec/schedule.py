"""A case's schedule: its query rows arriving in calls against the adapter's own KV cache
(docs/serving.md).

With P = S − T keys already in the cache before the first call (the "past"), call c of n_c rows
covers query rows [t0, t1), t1 = t0 + n_c, and appends key/value rows [P + t0, P + t1); call 0
also brings the past rows [0, P).  After call c the cache holds key rows [0, L_c), L_c = P + t1.
Causality aligned bottom-right makes every key ≥ L_c invisible to the call's rows, so a call's
expected values are rows [t0, t1) of the full pass, restricted to keys [0, L_c).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

CallKind = Literal["prefill", "decode", "chunk", "sequence"]  # sequence: a packed case's (spec/packed.py)


class Call(NamedTuple):
    """One call of a schedule: query rows [t0, t1) of the case, the cache length L_c after it, its kind
    (unpacks as ``t0, t1, cache, kind``)."""

    t0: int
    t1: int
    cache: int  # L_c = P + t1: key rows [0, L_c) are in the cache after the call
    kind: CallKind

    @property
    def rows(self) -> int:
        """n_c, the call's query rows."""
        return self.t1 - self.t0


def call_kind(index: int, rows: int) -> CallKind:
    """"prefill" (call 0), "decode" (one row, c > 0) or "chunk" (several rows, c > 0)."""
    if index == 0:
        return "prefill"
    return "decode" if rows == 1 else "chunk"


def schedule_calls(schedule: Sequence[int], tgt_len: int, src_len: int) -> list[Call]:
    """The calls of ``schedule`` (rows per call, summing to T = ``tgt_len``) against S = ``src_len``
    keys: the past P = S − T is in the cache before call 0."""
    past = src_len - tgt_len
    calls, t0 = [], 0
    for index, rows in enumerate(schedule):
        t1 = t0 + rows
        calls.append(Call(t0, t1, past + t1, call_kind(index, rows)))
        t0 = t1
    return calls


def call_rows(x: np.ndarray | None, call: Call) -> np.ndarray | None:
    """A (B|1, H|1, T|1, S) case input (the mask, the score bias) as ``call`` sees it: query rows
    [t0, t1) and keys [0, L_c) (an axis of length 1 broadcasts and stays); a view, no copy."""
    if x is None:
        return None
    rows = slice(call.t0, call.t1) if x.shape[2] > 1 else slice(None)
    return x[:, :, rows, :call.cache]


def call_label(index: int, call: Call, of: int) -> str:
    """How a verdict names call ``index`` (0-based) of ``of``: ``call 7 of 20 (decode, cache 135)`` (1-based);
    a packed case's sequence: ``sequence 2 of 4 (length 37)``."""
    if call.kind == "sequence":
        return f"sequence {index + 1} of {of} (length {call.cache})"
    return f"call {index + 1} of {of} ({call.kind}, cache {call.cache})"


def schedule_problem(schedule: Sequence[int], tgt_len: int, src_len: int, causal: bool, alignment: str) -> str | None:
    """Why ``schedule`` is not valid for a case (one line naming ``schedule``), or None."""
    bad = [f"schedule[{i}] = {n}" for i, n in enumerate(schedule) if n < 1]
    if not schedule:
        return "schedule: needs at least one call, got []"
    if bad:
        return f"schedule: every call has at least one query row, got {', '.join(bad)}"
    if sum(schedule) != tgt_len:
        return f"schedule: the calls' rows sum to {sum(schedule)}, expected T = tgt_len = {tgt_len}"
    if not causal or alignment != "bottom_right":
        return ("schedule: needs config.causal = true with causal_alignment = \"bottom_right\" (a call sees the cache, "
                f"never a later key), got causal = {str(causal).lower()}, causal_alignment = {alignment!r}")
    if src_len < tgt_len:
        return f"schedule: needs S >= T (S − T keys are in the cache before the first call), got T = {tgt_len}, S = {src_len}"
    return None
