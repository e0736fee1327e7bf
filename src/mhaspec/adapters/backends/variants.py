"""The attention variants' operations that read the same in every array library (docs/spec.md §2a),
written once against an array namespace ``xp`` (``jax.numpy``, ``keras.ops``, numpy) and its cast.

Each adapter computes them in its own framework and dtype: these are the framework's ops, not the
judge's float64 (that is :mod:`mhaspec.spec.variant_ops`).  Axis legend: B, T, S, H, H_kv, D_k
(:mod:`mhaspec.spec.config`); L a length (T or S), r = rotary_dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...spec.variants import RopeSpec

#: ``cast(x, dtype_name)``: the namespace's conversion (``jnp.astype``, ``keras.ops.cast``).
Cast = Callable[[Any, str], Any]


def rope_angles_dtype(dtype: str) -> str:
    """Where RoPE's angles, cos and sin are computed: float64 in a float64 run, else float32 (as HF's
    ``inv_freq`` and its rotary cache are)."""
    return "float64" if dtype == "float64" else "float32"


def rope_cos_sin(spec: RopeSpec, offset: int, length: int, dtype: str, xp: Any, cast: Cast) -> tuple[Any, Any]:
    """(cos, sin), each (L, r/2) in ``dtype``, of positions offset … offset + L − 1: ``inv_freq =
    1 / theta^(2k/r)``, the angle position · inv_freq, cos and sin in :func:`rope_angles_dtype`, then
    cast to the dtype."""
    at, r = rope_angles_dtype(dtype), spec.rotary_dim
    assert r is not None, "rope needs config.rope resolved (rotary_dim)"
    inv_freq = 1.0 / (cast(spec.theta, at) ** (xp.arange(0, r, 2, dtype=at) / cast(r, at)))  # (r/2,)
    angle = cast(offset + xp.arange(0, length, 1, dtype="int32"), at)[:, None] * inv_freq[None, :]  # (L, r/2)
    return cast(xp.cos(angle), dtype), cast(xp.sin(angle), dtype)


def rope(x: Any, heads: int, offset: int, spec: RopeSpec, dtype: str, xp: Any, cast: Cast) -> Any:
    """x (B, L, heads·D) turned by RoPE in its dtype, row l at position ``offset + l``: in each head,
    pair (a, b) -> (a·cos − b·sin, b·cos + a·sin), pairs (k, k + r/2) in style "half" and (2k, 2k + 1)
    in style "interleaved"; features past rotary_dim pass through.  -> (B, L, heads·D)."""
    B, L, F = (int(n) for n in x.shape)
    r = int(spec.rotary_dim)  # type: ignore[arg-type]
    cos, sin = rope_cos_sin(spec, offset, L, dtype, xp, cast)  # (L, r/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, L, 1, r/2)
    h = xp.reshape(x, (B, L, heads, F // heads))  # (B, L, heads, D)
    turned, rest = h[..., :r], h[..., r:]
    if spec.style == "half":
        a, b = turned[..., : r // 2], turned[..., r // 2:]
        turned = xp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:  # interleaved: (2k, 2k + 1)
        a, b = turned[..., 0::2], turned[..., 1::2]
        turned = xp.reshape(xp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1), (B, L, heads, r))
    return xp.reshape(xp.concatenate([turned, rest], axis=-1), (B, L, F))
