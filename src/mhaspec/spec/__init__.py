"""The specification: what MHA computes, named once (docs/spec.md §2).

Imports only numpy and pydantic.
"""

from .case import Case, CaseSpec, Dtype, Inputs, MaskSpec, Weights
from .catalog import CATALOG, Catalog, load_catalog_file
from .config import DTYPES, INPUT_NAMES, STAGES, WEIGHT_NAMES, MHAConfig
from .manifest import MANIFEST_NAME, SPEC_VERSION, Manifest, ManifestEntry

__all__ = [
    "CATALOG",
    "DTYPES",
    "INPUT_NAMES",
    "MANIFEST_NAME",
    "SPEC_VERSION",
    "STAGES",
    "WEIGHT_NAMES",
    "Case",
    "CaseSpec",
    "Catalog",
    "load_catalog_file",
    "Dtype",
    "Inputs",
    "MHAConfig",
    "Manifest",
    "ManifestEntry",
    "MaskSpec",
    "Weights",
]
