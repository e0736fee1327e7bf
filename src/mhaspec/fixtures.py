"""Golden fixtures on disk: one safetensors file per case plus ``manifest.json``.

The loader works on any folder (``--golden DIR``), verifies each file's size
and SHA-256 against the manifest before parsing it, and checks every tensor's
shape against the case's config.  Any problem is a :class:`FixtureError` that
names the file.  Writing is atomic: the new folder is built beside the old one
and swapped in with renames, so a failure leaves the old folder untouched.

Tensor names inside a file::

    input.query  input.key  input.value  [input.mask]      float64 / bool
    weight.w_q … weight.b_o                                float64
    stage.q_proj … stage.output                            float64
    grad.d_output                                          float64 (B, T, d_out)
    stage.d_concat … stage.d_b_o                           float64 (the case's backward stages)
    visible                                                bool (B, H, T, S)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydantic
from safetensors.numpy import load as st_load

from .errors import FixtureError
from .spec import (
    MANIFEST_NAME,
    SPEC_VERSION,
    BACKWARD_STAGES,
    STAGES,
    Case,
    CaseSpec,
    Manifest,
    ManifestEntry,
    backward_stage_shapes,
)

#: The package's own, committed golden folder.
DEFAULT_GOLDEN = Path(__file__).resolve().parent / "golden"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_ST_DTYPES = {np.dtype("float64"): "F64", np.dtype("bool"): "BOOL"}


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """safetensors bytes with a canonical layout: tensors sorted by name, keys sorted.

    Written here rather than with ``safetensors.numpy.save``, whose header order
    is not stable from one call to the next; the result is read back by the
    safetensors library like any other file.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if array.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name}: dtype {array.dtype} is not stored in fixtures")
        data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _ST_DTYPES[array.dtype], "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format pads the header to 8-byte alignment
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def encode_case(spec: CaseSpec, tensors: Mapping[str, np.ndarray]) -> bytes:
    """The safetensors bytes of one case."""
    return encode_safetensors(tensors, {"format": "mhaspec-golden", "case": spec.id, "spec_version": SPEC_VERSION})


def encode_manifest(manifest: Manifest) -> bytes:
    return (json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode("utf-8")


def decode_tensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    try:
        return dict(st_load(data))
    except Exception as exc:  # safetensors raises its own error types
        raise FixtureError(f"{where}: not a readable safetensors file ({exc})") from None


@dataclass(frozen=True)
class GoldenCase:
    """One verified fixture: the spec, the inputs and weights, every golden stage
    (forward and backward, by name) and the upstream gradient ``d_output``."""

    spec: CaseSpec
    inputs: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    stages: dict[str, np.ndarray]
    visible: np.ndarray  # (B, H, T, S) bool: explicit mask AND causal
    path: Path
    d_output: np.ndarray | None = None  # (B, T, d_out)
    _cases: dict[str, Case] = field(default_factory=dict, repr=False, compare=False)

    @property
    def id(self) -> str:
        return self.spec.id

    def case(self, dtype: str) -> Case:
        """The adapter-facing case (inputs and weights only, read-only copies)."""
        if dtype not in self._cases:
            self._cases[dtype] = Case.from_arrays(
                self.spec.id, self.spec.config, dtype, self.inputs, self.weights, self.spec.inputs == "self",
                self.d_output,
            )
        return self._cases[dtype]


def expected_shapes(spec: CaseSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a fixture of ``spec`` must hold."""
    cfg, B, T, S = spec.config, spec.batch, spec.tgt_len, spec.src_len
    shapes: dict[str, tuple[int, ...]] = {
        "input.query": (B, T, cfg.d_model),
        "input.key": (B, S, int(cfg.kdim)),  # type: ignore[arg-type]
        "input.value": (B, S, int(cfg.vdim)),  # type: ignore[arg-type]
        "visible": (B, cfg.H, T, S),
    }
    if spec.mask is not None:
        shapes["input.mask"] = (B, 1, 1, S) if spec.mask.kind == "key_padding" else (B, 1, T, S)
    shapes.update({f"weight.{k}": v for k, v in cfg.weight_shapes().items()})
    shapes.update({f"stage.{k}": v for k, v in cfg.stage_shapes(B, T, S).items()})
    shapes["grad.d_output"] = (B, T, cfg.d_out)
    shapes.update({f"stage.{k}": v for k, v in backward_stage_shapes(cfg, B, T, S, spec.inputs == "self").items()})
    return shapes


class GoldenSet:
    """A golden folder: its manifest, and verified loading of each case."""

    def __init__(self, folder: Path | str | None = None) -> None:
        self.folder = Path(folder) if folder is not None else DEFAULT_GOLDEN
        self.manifest = read_manifest(self.folder)
        self._entries = self.manifest.by_id()
        self._loaded: dict[str, GoldenCase] = {}

    def ids(self) -> list[str]:
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[GoldenCase]:
        for case_id in self._entries:
            yield self.load(case_id)

    def load(self, case_id: str) -> GoldenCase:
        if case_id not in self._loaded:
            entry = self._entries.get(case_id)
            if entry is None:
                raise FixtureError(
                    f"{self.folder / MANIFEST_NAME}: no case {case_id!r}; known: {', '.join(self._entries)}"
                )
            self._loaded[case_id] = load_case(self.folder, entry)
        return self._loaded[case_id]


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise FixtureError(f"{folder}: golden folder does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FixtureError(f"{path}: manifest is missing (not a golden folder; run `mhaspec generate --out {folder}`)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FixtureError(f"{path}: cannot read manifest ({exc})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FixtureError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    try:
        manifest = Manifest.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise FixtureError(f"{path}: invalid manifest\n{format_validation_error(exc)}") from None
    if manifest.spec_version != SPEC_VERSION:
        raise FixtureError(
            f"{path}: fixtures are for spec version {manifest.spec_version}, this mhaspec implements "
            f"{SPEC_VERSION}; regenerate them with `mhaspec generate --out {folder}`"
        )
    seen: set[str] = set()
    for i, entry in enumerate(manifest.cases):
        if entry.spec.id in seen:
            raise FixtureError(f"{path}: cases.{i}: duplicate case {entry.spec.id!r}")
        seen.add(entry.spec.id)
    return manifest


def load_case(folder: Path, entry: ManifestEntry) -> GoldenCase:
    """Read, verify (size, SHA-256, tensor names and shapes) and decode one fixture."""
    path = folder / entry.file
    if Path(entry.file).name != entry.file:
        raise FixtureError(f"{folder / MANIFEST_NAME}: file name {entry.file!r} must not contain a folder")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FixtureError(f"{path}: fixture file is missing (case {entry.spec.id})") from None
    except OSError as exc:
        raise FixtureError(f"{path}: cannot read fixture ({exc})") from None
    if len(data) != entry.size:
        raise FixtureError(
            f"{path}: truncated or altered fixture (case {entry.spec.id}): {len(data)} bytes, manifest says {entry.size}"
        )
    digest = sha256(data)
    if digest != entry.sha256:
        raise FixtureError(
            f"{path}: corrupted fixture (case {entry.spec.id}): SHA-256 {digest} does not match the manifest's {entry.sha256}"
        )
    tensors = decode_tensors(data, str(path))
    shapes = expected_shapes(entry.spec)
    missing = sorted(set(shapes) - set(tensors))
    extra = sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise FixtureError(f"{path}: tensors do not match case {entry.spec.id}: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if tensors[name].shape != shape:
            raise FixtureError(f"{path}: tensor {name} has shape {tensors[name].shape}, expected {shape}")
    inputs = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("input.")}
    weights = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("weight.")}
    stages = {name.split(".", 1)[1]: v for name, v in tensors.items() if name.startswith("stage.")}
    stages = {s: stages[s] for s in STAGES + BACKWARD_STAGES if s in stages}  # pipeline order
    return GoldenCase(entry.spec, inputs, weights, stages, tensors["visible"], path, tensors["grad.d_output"])


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One line per problem: ``  field.path: message``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def write_folder_atomically(folder: Path, files: Mapping[str, bytes]) -> None:
    """Replace ``folder`` with exactly ``files``; never leave it half-written.

    Refuses to replace a non-empty folder that is not a golden folder (one
    holding anything but ``manifest.json`` and ``*.safetensors``).
    """
    folder = folder.resolve()
    if folder.exists():
        if not folder.is_dir():
            raise FixtureError(f"{folder}: exists and is not a folder")
        foreign = [p.name for p in folder.iterdir() if not (p.name == MANIFEST_NAME or p.suffix == ".safetensors")]
        if foreign:
            raise FixtureError(
                f"{folder}: refusing to overwrite a folder that is not a golden folder (it holds {', '.join(sorted(foreign)[:5])})"
            )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new-", dir=folder.parent))
    try:
        for name, data in files.items():
            with open(staging / name, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(staging, 0o755)
        if folder.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            backup.rmdir()
            os.replace(folder, backup)
            try:
                os.replace(staging, folder)
            except BaseException:
                os.replace(backup, folder)
                raise
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
