"""The float64 reference that turns the spec into golden fixtures (imports ``spec`` only)."""

from .backward import backward
from .mha import (
    forward,
    merge_heads,
    output_projection,
    project,
    repeat_kv,
    scores,
    softmax,
    split_heads,
    visibility,
    weighted_sum,
)

__all__ = [
    "backward",
    "forward",
    "merge_heads",
    "output_projection",
    "project",
    "repeat_kv",
    "scores",
    "softmax",
    "split_heads",
    "visibility",
    "weighted_sum",
]
