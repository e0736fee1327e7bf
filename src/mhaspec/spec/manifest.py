"""The golden fixtures' manifest: spec version, each case's spec, each file's SHA-256."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .case import CaseSpec

#: Version of the specification the fixtures encode.  Bump it when the
#: semantics, the catalog or the fixture layout change.
SPEC_VERSION = "1.1"

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
