"""The specification: what MHA computes, named once (docs/spec.md §2).

Imports only numpy and pydantic.
"""

from .backward import (
    BACKWARD_STAGES,
    FOLDED_IN_SELF_ATTENTION,
    INPUT_GRADIENTS,
    PASSED_AS,
    backward_stage_shapes,
    make_d_output,
)
from .case import Case, CaseSpec, Dtype, Inputs, MaskSpec, Weights
from .catalog import BUILTIN_CATALOGS, CATALOG, Catalog, load_catalog_file, resolve_catalog
from .config import DTYPES, INPUT_NAMES, STAGES, WEIGHT_NAMES, MHAConfig
from .schedule import Call, call_label, schedule_calls
from .manifest import MANIFEST_NAME, SPEC_VERSION, Manifest, ManifestEntry
from .stages import (ALL_STAGES, INPUT_GRADIENT_STAGES, REGISTRY, STAGE, Stage, compared_entries, downstream,
                     gradient_of, stage)

__all__ = [
    "ALL_STAGES",
    "Call",
    "call_label",
    "schedule_calls",
    "INPUT_GRADIENT_STAGES",
    "REGISTRY",
    "STAGE",
    "Stage",
    "compared_entries",
    "downstream",
    "gradient_of",
    "stage",
    "BACKWARD_STAGES",
    "FOLDED_IN_SELF_ATTENTION",
    "INPUT_GRADIENTS",
    "PASSED_AS",
    "backward_stage_shapes",
    "make_d_output",
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
    "resolve_catalog",
    "BUILTIN_CATALOGS",
    "Dtype",
    "Inputs",
    "MHAConfig",
    "Manifest",
    "ManifestEntry",
    "MaskSpec",
    "Weights",
]
