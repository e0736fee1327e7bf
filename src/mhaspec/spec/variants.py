"""The attention variants (docs/spec.md §2a): sliding windows, softcap, ALiBi and an additive
bias, attention sinks and rotary position embeddings.

Every variant is off by default, so a spec-1.1 case is unchanged: its config, its JSON and its
fixture bytes.  This module holds what the config and the case need beyond plain fields:

* :class:`RopeSpec` — the ``rope`` sub-config (``theta``, ``style``, ``rotary_dim``,
  ``query_offset``, ``key_offset``);
* :class:`BiasSpec` — how a case's additive ``bias`` input (B|1, H|1, T, S) is made;
* :func:`standard_alibi_slopes` — the geometric ALiBi slopes of Press et al., correctly rounded;
* :data:`NOT_JUDGED_YET` and :func:`unjudged_features` — the variants that are specified but that
  the suite cannot judge yet (no tolerance rule): a case using one is refused where a user brings
  it (:class:`~mhaspec.spec.catalog.Catalog`).

Order of operations (docs/spec.md "Order of operations")::

    projections → RoPE → scale·QKᵀ → softcap → + bias / ALiBi → mask → softmax (with sinks)
    → P·V → concat → W^O
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import Context, Decimal
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from .case import CaseSpec
    from .config import MHAConfig

RopeStyle = Literal["half", "interleaved"]

#: The one name ``alibi_slopes`` takes instead of a list: the geometric slopes of Press et al.
STANDARD_SLOPES = "standard"


class RopeSpec(BaseModel):
    """Rotary position embeddings, applied to Q and K after the projections (docs/spec.md "RoPE").

    Query row i has position ``query_offset + i``, key j has position ``key_offset + j``.
    Pair k (k = 0 … rotary_dim/2 − 1) of a head turns by the angle position · theta^(−2k/rotary_dim).
    ``style="half"`` (GPT-NeoX, Llama, HF ``rotate_half``) pairs feature k with k + rotary_dim/2;
    ``style="interleaved"`` (GPT-J, Meta's original Llama) pairs 2k with 2k + 1.
    Only the first ``rotary_dim`` features of each head turn; the rest pass through.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    theta: float = Field(10000.0, gt=0, allow_inf_nan=False, description="base of the frequencies (> 0, finite)")
    style: RopeStyle = Field("half", description='"half" (NeoX/Llama: k with k + r/2) or "interleaved" (GPT-J: 2k with 2k+1)')
    rotary_dim: int | None = Field(None, gt=0, description="features of each head that turn; even, <= head_dim; "
                                   "default head_dim")
    query_offset: int = Field(0, ge=0, description="position of query row 0")
    key_offset: int = Field(0, ge=0, description="position of key 0")


class BiasSpec(BaseModel):
    """How a case's additive ``bias`` input is made: shape (B or 1, H or 1, T, S), values
    ``k · 2^-exponent`` with |k| <= 64 (exact in every dtype under test).

    Not to be confused with ``config.bias``, which says whether the four projections have
    biases ``b_q … b_o``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_batch: bool = Field(False, description="one bias per batch entry (B, …); False: shared (1, …)")
    per_head: bool = Field(True, description="one bias per head (…, H, T, S); False: shared (…, 1, T, S)")
    exponent: int = Field(4, ge=0, le=12, description="values are k * 2^-exponent, |k| <= 64")


def _round_to_float(value: Decimal, error: Decimal) -> float | None:
    """The float64 nearest to every real in [value − error, value + error], or None when the interval
    straddles a rounding boundary (float(Decimal) is correctly rounded, and rounding is monotone, so
    equal ends prove the result)."""
    lo, hi = float(value - error), float(value + error)
    return lo if lo == hi else None


def pow2_rational(numerator: int, denominator: int) -> float:
    """2^(numerator/denominator), correctly rounded to float64 (Ziv's test: the value at rising
    decimal precision until both ends of its error interval round alike)."""
    if numerator % denominator == 0:
        return math.ldexp(1.0, numerator // denominator)
    for prec in (40, 80, 160, 320):
        ctx = Context(prec=prec + 10)
        value = ctx.exp(ctx.multiply(ctx.divide(Decimal(numerator), Decimal(denominator)), ctx.ln(Decimal(2))))
        found = _round_to_float(value, value.copy_abs() * Decimal(10) ** -prec)
        if found is not None:
            return found
    raise ArithmeticError(f"2^({numerator}/{denominator}) could not be rounded")  # pragma: no cover


def standard_alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """The geometric ALiBi slopes of Press et al. (BLOOM, MPT; ``get_slopes`` of the ALiBi paper's code).

    For H a power of two, head h has slope 2^(−8(h+1)/H).  Otherwise, with m the largest power of two
    below H: the m slopes of m heads, then the slopes of 2m heads at even positions, 2^(−4(2k+1)/m)
    for k = 0 … H − m − 1.  Each correctly rounded to float64."""
    m = 1 << (num_heads.bit_length() - 1)
    slopes = [pow2_rational(-8 * (h + 1), m) for h in range(m)]
    slopes += [pow2_rational(-4 * (2 * k + 1), m) for k in range(num_heads - m)]
    return tuple(slopes)


def alibi_slope_values(config: MHAConfig) -> np.ndarray | None:
    """(H,) float64: the slope of each query head, or None without ALiBi."""
    slopes = config.alibi_slopes
    if slopes is None:
        return None
    if slopes == STANDARD_SLOPES:
        return np.array(standard_alibi_slopes(config.H), dtype=np.float64)
    return np.array(slopes, dtype=np.float64)


#: The variant fields of ``MHAConfig`` with their "off" value: a config dumps a variant field only
#: when it is on, so that a spec-1.1 config's JSON is the same bytes as before the variants existed.
CONFIG_VARIANT_DEFAULTS: dict[str, Any] = {
    "window_left": None, "window_right": None, "softcap": None, "alibi_slopes": None, "sinks": False, "rope": None,
}

#: The same for the variant fields of ``CaseSpec`` (the additive ``bias`` input).
CASE_VARIANT_DEFAULTS: dict[str, Any] = {"bias": None}


def drop_off_variants(dumped: Any, defaults: dict[str, Any]) -> Any:
    """``dumped`` (a model's dump) without the variant fields that are off (their default)."""
    if isinstance(dumped, dict):
        for name, off in defaults.items():
            if name in dumped and dumped[name] == off:
                del dumped[name]
    return dumped


def features(spec: CaseSpec) -> list[str]:
    """The variant fields a case uses, by the name a user writes: ``config.window_left``, …, ``bias``."""
    return used_fields(spec.config, spec.bias is not None)


def used_fields(config: MHAConfig, has_bias: bool) -> list[str]:
    """:func:`features` of a case with ``config`` and, if ``has_bias``, the additive ``bias`` input: what an
    adapter's ``Case`` (``case.inputs.bias``) or a golden case (``golden.inputs``) tells without the spec."""
    used = [f"config.{name}" for name, off in CONFIG_VARIANT_DEFAULTS.items() if getattr(config, name) != off]
    return used + (["bias"] if has_bias else [])


#: The name of each variant, as an adapter declares it (``variants``, docs/spec.md §5), with the fields
#: that use it.  An adapter computes a case only if it declares every variant the case uses; the rest
#: are reported ``unsupported`` (never run, never a pass).
VARIANTS: dict[str, tuple[str, ...]] = {
    "window": ("config.window_left", "config.window_right"),
    "softcap": ("config.softcap",),
    "alibi": ("config.alibi_slopes",),
    "bias": ("bias",),
    "sinks": ("config.sinks",),
    "rope": ("config.rope",),
}


def variants_used(spec: CaseSpec) -> list[str]:
    """The variants (:data:`VARIANTS` names, in that order) that ``spec`` uses."""
    used = set(features(spec))
    return [name for name, fields in VARIANTS.items() if used.intersection(fields)]


def undeclared(spec: CaseSpec, declared: Iterable[str]) -> str | None:
    """Why an adapter that declares the variants ``declared`` cannot compute ``spec`` (one line), or None."""
    missing = [name for name in variants_used(spec) if name not in set(declared)]
    if not missing:
        return None
    return (f"the adapter does not declare the variant{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"(its 'variants' attribute)")


#: Variants that are specified (docs/spec.md §2a) and computed by the exact reference, but that the
#: suite cannot judge yet (no tolerance rule): a case using one is refused where a user brings it.
#: Empty: the forward of every variant is judged, in every dtype (the fast reference computes each
#: with its error bound, the tolerance model has a rule for each).  The backward of a case with a
#: variant is not judged yet: its fixture holds no backward stages and ``--backward`` says so.
NOT_JUDGED_YET: frozenset[str] = frozenset()


def unjudged_features(spec: CaseSpec) -> list[str]:
    """The fields of ``spec`` that are specified but not judged yet (:data:`NOT_JUDGED_YET`)."""
    return [name for name in features(spec) if name in NOT_JUDGED_YET]


def refusal(spec: CaseSpec) -> str | None:
    """Why ``spec`` cannot be judged (one line naming the case and its fields), or None."""
    fields = unjudged_features(spec)
    if not fields:
        return None
    return (f"case {spec.id}: {', '.join(fields)} {'is' if len(fields) == 1 else 'are'} specified (docs/spec.md "
            f"§2a) but not judged yet: mhaspec has no tolerance for {'it' if len(fields) == 1 else 'them'}, so it "
            f"cannot give a verdict on this case; remove the field to judge the rest")
