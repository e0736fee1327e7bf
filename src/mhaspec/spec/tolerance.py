"""The tolerance table: the constants of the element-wise error model.

The model itself (how the bounds propagate through the stages, one rule per
stage) lives in :mod:`mhaspec.conformance.model` and is written up in
``docs/tolerances.md``.  This table holds only the numbers it uses, so they
are visible in ``mhaspec schema`` and in one place.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .config import DTYPES


class DtypeRule(BaseModel):
    """Rounding facts of one dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unit_roundoff: float = Field(gt=0, description="u = 2^-p: the relative error of one rounding to nearest")
    floor: float = Field(ge=0, description="absolute allowance for underflow: the smallest normal number")


class ToleranceTable(BaseModel):
    """Constants of the element-wise error bound (see docs/tolerances.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtypes: dict[str, DtypeRule]
    extra_ops: int = Field(
        4,
        ge=0,
        description="roundings allowed on top of the n of a length-n dot product: bias add, scale, "
        "storing the stage in the dtype under test, and the golden's own rounding",
    )


DEFAULT_TOLERANCES = ToleranceTable(
    dtypes={
        "float64": DtypeRule(unit_roundoff=2.0**-53, floor=2.0**-1022),
        "float32": DtypeRule(unit_roundoff=2.0**-24, floor=2.0**-126),
        "float16": DtypeRule(unit_roundoff=2.0**-11, floor=2.0**-14),
        "bfloat16": DtypeRule(unit_roundoff=2.0**-8, floor=2.0**-126),
    }
)

assert set(DEFAULT_TOLERANCES.dtypes) == set(DTYPES)
