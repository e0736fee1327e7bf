"""Golden fixtures on disk: one safetensors file per case plus ``manifest.json``.

The loader works on any folder (``--golden DIR``).  Before reading a file's
tensor data it checks the file's size (against the manifest and against what
the case's tensors need) and its header (tensor names, dtypes, shapes); then
the SHA-256.  Any problem is a :class:`FixtureError` that names the file; the
runner makes it an ``error`` of that case only.  Writing is atomic and locked:
see :func:`write_folder_atomically`.

Tensor names inside a file::

    input.query  input.key  input.value  [input.mask]      float64 / bool
    [input.bias]                                           float64 (B|1, H|1, T, S)
    weight.w_q … weight.b_o  [weight.sink_logits]          float64
    stage.q_proj … stage.output                            float64
    grad.d_output                                          float64 (B, T, d_out)
    stage.d_concat … stage.d_b_o                           float64 (the case's backward stages)
    visible                                                bool (B, H, T, S)

A case using a variant (docs/spec.md §2a) stores, besides, ``stage.lse`` (and ``stage.q_rot``,
``stage.k_rot`` with RoPE: :func:`stored_forward_stages`), and among its backward stages the variants'
gradients it has (``stage.d_sink_logits`` with sinks, ``stage.d_bias`` with a bias input,
``stage.d_q_rot``, ``stage.d_k_rot`` with RoPE).  A spec-1.1 fixture stores no ``lse``: :func:`load_case`
computes it from the exact scores, with its error bound in ``reference_error`` (:class:`StageErrors`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydantic

from .errors import FixtureError
from .io import atomic, safetensors
from .spec import (
    MANIFEST_NAME,
    SPEC_VERSION,
    STAGE,
    STAGES,
    BACKWARD_STAGES,
    Case,
    CaseSpec,
    Manifest,
    ManifestEntry,
    backward_stage_shapes,
)
from .spec.manifest import READABLE_SPEC_VERSIONS, case_spec_version
from .spec.stages import forward_stages
from .spec.variants import variants_used

#: The package's own, committed golden folder.
DEFAULT_GOLDEN = Path(__file__).resolve().parent / "golden"


def in_source_checkout() -> bool:
    """Whether this mhaspec runs from a source checkout (``src/mhaspec`` beside ``pyproject.toml``:
    an editable install or ``PYTHONPATH=src``), where the shipped fixtures are files of the
    repository; False for an installed package, whose folder is not to be written."""
    package = Path(__file__).resolve().parent
    return package.parent.name == "src" and (package.parent.parent / "pyproject.toml").is_file()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: The dtypes a fixture stores: float64 tensors, bool masks.
_ST_DTYPES = (np.dtype("float64"), np.dtype("bool"))


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """safetensors bytes with a canonical layout: tensors sorted by name, keys sorted
    (:func:`mhaspec.io.safetensors.encode`; any safetensors reader reads them)."""
    for name, value in tensors.items():
        if np.asarray(value).dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name}: dtype {np.asarray(value).dtype} is not stored in fixtures")
    return safetensors.encode(tensors, metadata)


def encode_case(spec: CaseSpec, tensors: Mapping[str, np.ndarray]) -> bytes:
    """The safetensors bytes of one case."""
    return encode_safetensors(tensors, {"format": "mhaspec-golden", "case": spec.id,
                                        "spec_version": case_spec_version(spec)})


def encode_manifest(manifest: Manifest) -> bytes:
    return (json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode("utf-8")


def decode_tensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    """The tensors of a fixture file's bytes (writeable arrays of their own)."""
    try:
        return safetensors.decode(data, copy=True)
    except safetensors.SafetensorsError as exc:
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
    #: Bound of each stage's distance to the exact reference (None: every stage exact).  The fast
    #: reference's cases name every stage; a spec-1.1 fixture, whose ``lse`` is computed at load, names
    #: only ``lse`` (:class:`StageErrors`: a stage it does not name is exact, 0.0).
    reference_error: Mapping[str, np.ndarray | float] | None = field(default=None, repr=False, compare=False)
    _cases: dict[str, Case] = field(default_factory=dict, repr=False, compare=False)
    #: SHA-256 of the fixture file this case was read from, as verified by :func:`load_case`; None: not
    #: read from a file (computed on the fly, or one block of a case).
    sha256: str | None = field(default=None, repr=False, compare=False)
    #: For one block of query rows of a case (``spec.tgt_len`` = the block's rows): the case row of the
    #: block's first row, and the whole case's T.  What depends on a row's place in the case (RoPE
    #: positions, ALiBi distances, windows, causal alignment: spec/variant_ops.py) is recomputed with them.
    row_offset: int = 0
    case_tgt_len: int | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def whole_tgt_len(self) -> int:
        """T of the whole case this golden case is (a block of rows of)."""
        return self.spec.tgt_len if self.case_tgt_len is None else self.case_tgt_len

    def case(self, dtype: str) -> Case:
        """The adapter-facing case (inputs and weights only, read-only copies)."""
        if dtype not in self._cases:
            self._cases[dtype] = Case.from_spec(self.spec, dtype, self.inputs, self.weights, self.d_output)
        return self._cases[dtype]

    def forget_case(self, dtype: str) -> None:
        """Drop the adapter-facing case of ``dtype`` (its read-only copies of the inputs and weights, ~10 MB
        at T = S = 1024): once the adapter has returned, the judge reads the golden's own arrays; a later
        :meth:`case` makes it again."""
        self._cases.pop(dtype, None)


class StageErrors(dict):  # type: ignore[type-arg]
    """A golden case's ``reference_error``: the bound of each stage's distance to the exact reference,
    by stage name; a stage it does not name is exact (``errors[stage]`` is 0.0)."""

    def __missing__(self, name: str) -> float:
        return 0.0


class LazyStages(Mapping[str, Any]):
    """The stages (or reference errors) of a :class:`RowBlocks` case: their names and shapes are
    known; their values are computed whole only when someone reads one (``compute()``: every value
    by name, asked once and shared by the mappings made with the same ``compute``)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], compute: Callable[[], Mapping[str, Any]]) -> None:
        self._shapes = dict(shapes)
        self._compute = compute

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def __getitem__(self, name: str) -> Any:
        if name not in self._shapes:
            raise KeyError(name)
        return self._compute()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


@dataclass(frozen=True)
class RowBlocks(GoldenCase):
    """A large golden case computed on the fly whose stages are made one block of query rows at a
    time (:meth:`block`, called by :mod:`mhaspec.conformance.blocks`) instead of being held whole.

    ``stages`` and ``reference_error`` are :class:`LazyStages`: the names and shapes are there, and
    reading a value computes the whole case (a failing case's diagnosis does; judging does not).
    ``make_block(b, t0, t1)`` gives batch entry b's rows [t0, t1) as a case of its own (B = 1), the
    same numbers as those rows of the whole case; blocks start at multiples of ``block_rows``."""

    block_rows: int = 0
    make_block: Callable[[int, int, int], GoldenCase] | None = field(default=None, repr=False, compare=False)

    def block(self, b: int, t0: int, t1: int) -> GoldenCase:
        assert self.make_block is not None
        return self.make_block(b, t0, t1)


def stored_forward_stages(spec: CaseSpec) -> tuple[str, ...]:
    """The forward stages the fixture of ``spec`` stores, in pipeline order: a case using a variant
    (docs/spec.md §2a) every forward stage it has, ``lse`` (and ``q_rot``, ``k_rot`` with RoPE) among
    them; a spec-1.1 case those of spec 1.1 (the same bytes as before the variants existed)."""
    return forward_stages(spec.config) if variants_used(spec) else STAGES


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
    if spec.bias is not None:
        shapes["input.bias"] = (B if spec.bias.per_batch else 1, cfg.H if spec.bias.per_head else 1, T, S)
    shapes.update({f"weight.{k}": v for k, v in cfg.weight_shapes().items()})
    shapes.update({f"stage.{k}": v for k, v in cfg.stage_shapes(B, T, S).items()})
    if variants_used(spec):
        shapes.update({f"stage.{k}": v for k, v in cfg.variant_stage_shapes(B, T, S).items()})
    shapes["grad.d_output"] = (B, T, cfg.d_out)
    shapes.update({f"stage.{k}": v for k, v in backward_stage_shapes(cfg, B, T, S, spec.inputs, shapes.get("input.bias")).items()})
    return shapes


class GoldenSet:
    """A golden folder: its manifest, and verified loading of each case."""

    def __init__(self, folder: Path | str | None = None) -> None:
        self.folder = Path(folder) if folder is not None else DEFAULT_GOLDEN
        self.manifest = read_manifest(self.folder)
        self._entries = self.manifest.by_id()
        self._loaded: dict[str, GoldenCase] = {}
        self._failed: dict[str, FixtureError] = {}

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
            if case_id in self._failed:  # a broken file is read (and reported) once
                raise self._failed[case_id]
            try:
                self._loaded[case_id] = load_case(self.folder, entry)
            except FixtureError as exc:
                self._failed[case_id] = exc
                raise
        return self._loaded[case_id]


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_NAME
    if folder.is_file():
        raise FixtureError(f"{folder}: is a file; a golden folder (holding {MANIFEST_NAME}) is expected")
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
    if manifest.spec_version not in READABLE_SPEC_VERSIONS:
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


#: Largest safetensors header accepted in a fixture (a case's header is a few KB).
MAX_HEADER_BYTES = 1 << 20

_ITEMSIZE = {"F64": 8, "BOOL": 1}


def expected_dtype(name: str) -> str:
    """The safetensors dtype a fixture tensor must be stored as."""
    return "BOOL" if name in ("input.mask", "visible") else "F64"


def fixture_data_bytes(spec: CaseSpec) -> int:
    """Bytes of tensor data in the fixture of ``spec`` (its file is this plus a small header)."""
    return sum(math.prod(shape) * _ITEMSIZE[expected_dtype(name)] for name, shape in expected_shapes(spec).items())


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation now (Linux: MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def require_memory(spec: CaseSpec, needed: int, what: str) -> None:
    """Refuse (FixtureError, with the numbers) when ``needed`` bytes exceed the available memory."""
    available = available_memory()
    if available is not None and needed > available:
        cfg = spec.config
        raise FixtureError(
            f"case {spec.id}: {what} needs about {needed / 1e9:.3g} GB (B={spec.batch}, T={spec.tgt_len}, "
            f"S={spec.src_len}, d_model={cfg.d_model}, H={cfg.H}, D_k={cfg.D_k}, D_v={cfg.D_v}), "
            f"but only {available / 1e9:.3g} GB of memory is available"
        )


def _read_header(fh: Any, path: Path, size: int) -> dict[str, Any]:
    """The JSON header of an open safetensors file, bounded and parsed before any tensor data is read."""
    try:
        n = safetensors.header_length(fh.read(safetensors.PREFIX))
        if n > MAX_HEADER_BYTES or safetensors.PREFIX + n > size:
            raise FixtureError(f"{path}: not a safetensors file (header length {n} bytes is implausible for a "
                               f"{size}-byte file)")
        return safetensors.parse_header(fh.read(n))
    except safetensors.SafetensorsError as exc:
        raise FixtureError(f"{path}: not a safetensors file ({exc})") from None


#: What a variant case's fixture that lacks its backward is: one written before the variants' backward was
#: specified (it held the forward only), to be regenerated.
FORWARD_ONLY_HINT = ("; a fixture of an attention-variant case written by an mhaspec before the variants' backward was "
                     "specified holds the forward only: regenerate the folder with `mhaspec generate --out FOLDER`")


def _check_header(header: dict[str, Any], path: Path, spec: CaseSpec, data_size: int) -> None:
    """Tensor names, dtypes, shapes and offsets of a fixture, from its header alone."""
    shapes = expected_shapes(spec)
    names = set(header) - {"__metadata__"}
    missing, extra = sorted(set(shapes) - names), sorted(names - set(shapes))
    if missing or extra:
        raise FixtureError(f"{path}: tensors do not match case {spec.id}: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        info = header[name]
        if not isinstance(info, dict):
            raise FixtureError(f"{path}: tensor {name}: malformed header entry")
        if info.get("dtype") != expected_dtype(name):
            raise FixtureError(f"{path}: tensor {name} is stored as {info.get('dtype')}, expected {expected_dtype(name)}")
        if tuple(info.get("shape", ())) != shape:
            raise FixtureError(f"{path}: tensor {name} has shape {tuple(info.get('shape', ()))}, expected {shape}")
        start, end = info.get("data_offsets", (None, None))
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_size
                and end - start == math.prod(shape) * _ITEMSIZE[info["dtype"]]):
            raise FixtureError(f"{path}: tensor {name} has bad data offsets {info.get('data_offsets')}")


def load_case(folder: Path, entry: ManifestEntry) -> GoldenCase:
    """Read, verify and decode one fixture.

    Before any tensor data is read: the file's size against the manifest and
    against what the case's tensors need, and the header's tensor names,
    dtypes, shapes and offsets.  Then the SHA-256 of the whole file.
    """
    path = folder / entry.file
    if Path(entry.file).name != entry.file:
        raise FixtureError(f"{folder / MANIFEST_NAME}: file name {entry.file!r} must not contain a folder")
    data_bytes = fixture_data_bytes(entry.spec)
    if not data_bytes + 8 < entry.size <= data_bytes + 8 + MAX_HEADER_BYTES:
        raise FixtureError(
            f"{folder / MANIFEST_NAME}: case {entry.spec.id}: size {entry.size} bytes does not fit its tensors "
            f"({data_bytes} bytes of data plus a header)"
            f"{FORWARD_ONLY_HINT if entry.size <= data_bytes and variants_used(entry.spec) else ''}"
        )
    require_memory(entry.spec, 2 * entry.size, f"loading {path.name}")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != entry.size:
                raise FixtureError(
                    f"{path}: truncated or altered fixture (case {entry.spec.id}): {size} bytes, manifest says {entry.size}"
                )
            header = _read_header(fh, path, size)
            _check_header(header, path, entry.spec, size - fh.tell())
            fh.seek(0)
            data = fh.read()
    except FileNotFoundError:
        raise FixtureError(f"{path}: fixture file is missing (case {entry.spec.id})") from None
    except IsADirectoryError:
        raise FixtureError(f"{path}: is a folder, not a fixture file (case {entry.spec.id})") from None
    except OSError as exc:
        raise FixtureError(f"{path}: cannot read fixture ({exc.strerror or exc})") from None
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
    for name, shape in shapes.items():
        if tensors[name].shape != shape or tensors[name].dtype != (np.bool_ if expected_dtype(name) == "BOOL" else np.float64):
            raise FixtureError(f"{path}: tensor {name} has shape {tensors[name].shape} and dtype {tensors[name].dtype}, expected {shape}")
    inputs = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("input.")}
    weights = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("weight.")}
    stages = {name.split(".", 1)[1]: v for name, v in tensors.items() if name.startswith("stage.")}
    error = None
    if STAGE.lse not in stages:  # a spec-1.1 fixture: its lse from its exact scores, with a bound
        from .reference.fast import lse_of_exact_scores  # (the reference imports this module's users)

        stages[STAGE.lse], lse_error = lse_of_exact_scores(stages[STAGE.scores], tensors["visible"],
                                                           weights.get("sink_logits"))
        error = StageErrors({STAGE.lse: lse_error})
    stages = {s: stages[s] for s in forward_stages(entry.spec.config) + BACKWARD_STAGES if s in stages}  # pipeline order
    return GoldenCase(entry.spec, inputs, weights, stages, tensors["visible"], path, tensors.get("grad.d_output"),
                      reference_error=error, sha256=digest)


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One line per problem: ``  field.path: message``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def write_folder_atomically(folder: Path, files: Mapping[str, bytes]) -> None:
    """Replace ``folder`` with exactly ``files``; never leave it half-written, never destroy what mhaspec did not write.

    - Only an empty or missing folder, or a golden folder (a valid mhaspec
      ``manifest.json`` plus exactly the files it lists), is replaced
      (:func:`check_replaceable`).
    - The swap is :func:`mhaspec.io.atomic.replace_folder`: the new folder is
      written beside it (manifest last, every file fsync'ed) and exchanged with
      the old one atomically; a reader sees the old folder or the new one, never
      none; concurrent generates are serialised by a lock on the parent folder.
    Any OS error is a FixtureError naming the folder.
    """
    folder = Path(folder).absolute()
    try:
        atomic.replace_folder(folder, files, check=check_replaceable, last=MANIFEST_NAME)
    except OSError as exc:
        raise FixtureError(f"{folder}: cannot write the golden folder ({exc.strerror or exc})") from None


def check_replaceable(folder: Path) -> None:
    """FixtureError unless ``folder`` is missing, empty, or a golden folder holding only what its manifest lists."""
    if not folder.exists() and not folder.is_symlink():
        return
    if not folder.is_dir():
        raise FixtureError(f"{folder}: exists and is not a folder")
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return
    shown = ", ".join(names[:5]) + (f", … ({len(names)} in all)" if len(names) > 5 else "")
    if MANIFEST_NAME not in names:
        raise FixtureError(f"{folder}: refusing to replace a folder that is not an mhaspec golden folder "
                           f"(no {MANIFEST_NAME}; it holds {shown})")
    try:
        raw = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        if raw.get("format") != "mhaspec-golden":
            raise ValueError("format is not mhaspec-golden")
        listed = {str(case["file"]) for case in raw["cases"]}
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise FixtureError(f"{folder}: refusing to replace a folder whose {MANIFEST_NAME} is not an mhaspec "
                           f"manifest ({exc})") from None
    foreign = sorted(set(names) - listed - {MANIFEST_NAME})
    if foreign:
        raise FixtureError(f"{folder}: refusing to replace a golden folder holding files its manifest does not list "
                           f"({', '.join(foreign[:5])}{', …' if len(foreign) > 5 else ''})")


def precheck_replaceable(folder: Path) -> None:
    """:func:`check_replaceable` before the work, under the same lock as the write: a concurrent
    generate swapping the folder in between listing its files and reading its manifest would
    otherwise make a golden folder look foreign.  The write checks again (the folder may change
    in between)."""
    folder = Path(folder).absolute()
    if not folder.parent.is_dir():
        return  # nothing there yet
    try:
        with atomic.folder_lock(folder.parent):
            check_replaceable(folder)
    except OSError as exc:
        raise FixtureError(f"{folder}: cannot read the golden folder ({exc.strerror or exc})") from None
