"""What the judging side keeps about a golden case while it judges it (not part of the data).

Interim: delegates to the GoldenCase methods of the same names until that state moves here.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping


def memoised(golden: Any, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``, once for every block of query rows of a batch entry (see blocks.py)."""
    return golden.memoised(key, compute)


def whole_shape(golden: Any) -> tuple[int, int, int, int]:
    """(B, H, T, S) of the whole case ``golden`` is a block of (its own shape when it is whole)."""
    return golden.whole_shape or golden.visible.shape


def with_reference_error(golden: Any, bounds: Mapping[str, Any]) -> dict[str, Any]:
    """``bounds`` widened by the golden's own error bound (unchanged for an exact fixture)."""
    return golden.with_reference_error(bounds)


def derived(golden: Any, key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, once per process for a fixture read from a file."""
    return golden.derived(key, compute)
