"""Golden fixtures from the case catalog: generate (atomically) and check (in memory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FixtureError, SpecError
from ..fixtures import (
    DEFAULT_GOLDEN,
    decode_tensors,
    encode_case,
    encode_manifest,
    fixture_data_bytes,
    require_memory,
    precheck_replaceable,
    sha256,
    stored_forward_stages,
    write_folder_atomically,
)
from ..spec import CATALOG, MANIFEST_NAME, SPEC_VERSION, STAGES, Catalog, CaseSpec, Manifest, ManifestEntry
from .backward import backward
from .mha import forward, visibility


def case_tensors(spec: CaseSpec) -> dict[str, np.ndarray]:
    """Inputs, weights, every stage and the visibility of one case, by fixture tensor name.

    The forward stages it stores (:func:`~mhaspec.fixtures.stored_forward_stages`: a spec-1.1 case the
    same bytes as before the variants existed; a case using a variant ``lse`` too, and ``q_rot``,
    ``k_rot`` with RoPE), ``d_output`` and every backward stage it has (a variant's gradients with it)."""
    inputs = spec.make_inputs()
    weights = spec.make_weights()
    stages = forward(spec.config, inputs, weights, spec.seq_lens)
    visible = visibility(spec.config, inputs.get("mask"), spec.batch, spec.tgt_len, spec.src_len, spec.seq_lens)
    tensors = {f"input.{k}": v for k, v in inputs.items()}
    tensors.update({f"weight.{k}": v for k, v in weights.items()})
    tensors["visible"] = visible
    tensors.update({f"stage.{k}": stages[k] for k in stored_forward_stages(spec)})
    d_output = spec.make_d_output()
    grads = backward(spec.config, inputs, weights, stages, visible, d_output, spec.inputs)
    tensors["grad.d_output"] = d_output
    tensors.update({f"stage.{k}": v for k, v in grads.items()})
    return tensors


#: Peak memory of computing one case, as a multiple of its fixture's tensor data (copies of the
#: stages, plus the exact softmax's per-element Python objects, counted separately below).
MEMORY_FACTOR = 4
BYTES_PER_SCORE = 200


def case_memory(spec: CaseSpec) -> int:
    """Estimated peak bytes of computing the fixture of ``spec``."""
    scores = spec.batch * spec.config.H * spec.tgt_len * spec.src_len
    return MEMORY_FACTOR * fixture_data_bytes(spec) + BYTES_PER_SCORE * scores


def checked_case_tensors(spec: CaseSpec) -> dict[str, np.ndarray]:
    """:func:`case_tensors`, refusing up front what memory cannot hold and afterwards a golden that is not finite."""
    require_memory(spec, case_memory(spec), "computing its fixture")
    # Inputs and weights are bounded by construction (|k| <= 64 times a power of two), so the one
    # field that can push the golden beyond float64 is the unbounded config.scale.
    try:
        with np.errstate(all="ignore"):
            tensors = case_tensors(spec)
    except ArithmeticError as exc:  # decimal.Overflow in the exact softmax
        raise SpecError(f"case {spec.id}: config.scale={spec.config.scale:g} makes the scores overflow float64 "
                        f"({type(exc).__name__} in the exact softmax): reduce config.scale") from None
    for stage in STAGES:  # (lse is −inf where a row sees no key)
        values = tensors[f"stage.{stage}"]
        if not np.isfinite(values).all():
            raise SpecError(
                f"case {spec.id}: stage {stage} overflows float64 ({np.count_nonzero(~np.isfinite(values))} "
                f"non-finite values at config.scale={spec.config.scale:g}): reduce config.scale"
            )
    return tensors


def build_files(catalog: Catalog = CATALOG, progress: Callable[[CaseSpec], None] | None = None) -> dict[str, bytes]:
    """Every file of a golden folder, in memory: ``<case>.safetensors`` and ``manifest.json``;
    ``progress(spec)`` is called before each case is computed."""
    files: dict[str, bytes] = {}
    entries: list[ManifestEntry] = []
    for spec in catalog:
        if progress is not None:
            progress(spec)
        data = encode_case(spec, checked_case_tensors(spec))
        name = f"{spec.id}.safetensors"
        files[name] = data
        entries.append(ManifestEntry(file=name, sha256=sha256(data), size=len(data), spec=spec))
    files[MANIFEST_NAME] = encode_manifest(Manifest(spec_version=SPEC_VERSION, cases=entries))
    return files


def generate(out: Path | str | None = None, catalog: Catalog = CATALOG,
             progress: Callable[[CaseSpec], None] | None = None) -> Path:
    """Write the golden folder for ``catalog`` into ``out`` (default: the package's own).

    The package's shipped fixtures come only from the built-in catalog: another
    catalog needs an ``out`` folder of its own.  ``progress(spec)``: before each case is computed.
    """
    folder = Path(out) if out is not None else DEFAULT_GOLDEN
    if catalog is not CATALOG and folder.absolute().resolve() == DEFAULT_GOLDEN.resolve():
        raise FixtureError(
            f"{folder}: refusing to write a custom catalog over the fixtures shipped with mhaspec "
            "(they come only from the built-in catalog); give --out DIR"
        )
    precheck_replaceable(folder)  # fail before computing; checked again when writing
    write_folder_atomically(folder, build_files(catalog, progress))
    return folder


@dataclass(frozen=True)
class Drift:
    """One way a golden folder differs from what the reference computes now."""

    case: str  # case id, or "manifest"
    detail: str

    def __str__(self) -> str:
        return f"{self.case}: {self.detail}"


def check(folder: Path | str | None = None, catalog: Catalog = CATALOG,
          progress: Callable[[CaseSpec], None] | None = None) -> list[Drift]:
    """Recompute everything in memory and compare with ``folder``; write nothing.

    Returns one :class:`Drift` per case and tensor that differs (empty: current).
    ``progress(spec)``: before each case is computed.
    """
    folder = Path(folder) if folder is not None else DEFAULT_GOLDEN
    if not folder.is_dir():
        raise FixtureError(f"{folder}: golden folder does not exist")
    fresh = build_files(catalog, progress)
    drifts: list[Drift] = []
    on_disk = {p.name for p in folder.iterdir() if p.is_file()}
    for name in sorted(on_disk - set(fresh)):
        drifts.append(Drift(name.removesuffix(".safetensors"), f"{name} is not produced by the catalog (stale file)"))
    for spec in catalog:
        name = f"{spec.id}.safetensors"
        path = folder / name
        if name not in on_disk:
            drifts.append(Drift(spec.id, f"{name} is missing"))
            continue
        old = path.read_bytes()
        if old != fresh[name]:
            drifts.extend(_diff_case(spec.id, old, fresh[name], str(path)))
    manifest = folder / MANIFEST_NAME
    if MANIFEST_NAME not in on_disk:
        drifts.append(Drift("manifest", f"{MANIFEST_NAME} is missing"))
    elif manifest.read_bytes() != fresh[MANIFEST_NAME]:
        drifts.append(Drift("manifest", f"{MANIFEST_NAME} differs (spec version, a case's config, or a file hash)"))
    return drifts


def _diff_case(case_id: str, old: bytes, new: bytes, where: str) -> list[Drift]:
    """Name the tensors (stages, inputs, weights) that differ between two encodings of a case."""
    try:
        old_t = decode_tensors(old, where)
    except FixtureError as exc:
        return [Drift(case_id, f"file is unreadable ({exc})")]
    new_t = decode_tensors(new, "<regenerated>")
    out = []
    for name in sorted(set(old_t) | set(new_t)):
        if name not in old_t or name not in new_t:
            out.append(Drift(case_id, f"{name} is {'missing' if name not in old_t else 'unexpected'}"))
        elif old_t[name].shape != new_t[name].shape:
            out.append(Drift(case_id, f"{name} shape {old_t[name].shape} != {new_t[name].shape}"))
        elif not np.array_equal(old_t[name], new_t[name]):
            diff = np.abs(old_t[name].astype(np.float64) - new_t[name].astype(np.float64))
            out.append(Drift(case_id, f"{name} differs (max abs difference {np.nanmax(diff):.3g})"))
    if not out:
        out.append(Drift(case_id, "file bytes differ (metadata or layout)"))
    return out
