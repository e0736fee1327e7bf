"""The golden fixtures' manifest: spec version, each case's spec, each file's SHA-256."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .case import CaseSpec
from .variants import variants_used

#: Version of the specification the fixtures encode.  Bump it when the
#: semantics, the catalog or the fixture layout change.  1.2: the attention
#: variants (docs/spec.md §2a) and their cases.
SPEC_VERSION = "1.2"

#: The spec version that introduced the cases without a variant: their fixture files
#: still say it, byte-identical to spec 1.1's (:func:`case_spec_version`).
SPEC_VERSION_WITHOUT_VARIANTS = "1.1"

#: Golden folders this mhaspec reads: a spec-1.1 folder holds only cases without variants,
#: whose files are the same bytes in spec 1.2.
READABLE_SPEC_VERSIONS = (SPEC_VERSION_WITHOUT_VARIANTS, SPEC_VERSION)


def case_spec_version(spec: CaseSpec) -> str:
    """The spec version a fixture file of ``spec`` records: the first that defines what the case uses
    (1.1 for a case without a variant, a schedule or seq_lens, so its file keeps the bytes it had in spec 1.1)."""
    served = spec.schedule is not None or spec.seq_lens is not None
    return SPEC_VERSION if variants_used(spec) or served else SPEC_VERSION_WITHOUT_VARIANTS

MANIFEST_NAME = "manifest.json"


class ManifestEntry(BaseModel):
    """One fixture file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(description="file name inside the golden folder")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file's bytes")
    size: int = Field(ge=0, description="file size in bytes")
    spec: CaseSpec = Field(description="the case this file was generated from (config with every size resolved)")


class Manifest(BaseModel):
    """``manifest.json`` of a golden folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["mhaspec-golden"] = "mhaspec-golden"
    spec_version: str
    cases: list[ManifestEntry] = Field(description="one entry per case, in catalog order")

    def by_id(self) -> dict[str, ManifestEntry]:
        return {entry.spec.id: entry for entry in self.cases}
