"""The adapter contract: what an implementation under test is, and the deviations it may declare.

An adapter is any object with ``name`` and ``run(case) -> Mapping[str, ArrayLike]``
(docs/spec.md §5); optional: ``supports(case) -> bool | str``, ``backward(case)``,
``known_deviations`` (see :class:`Deviation`), ``dtypes``, ``variants`` (the attention variants
of docs/spec.md §2a it computes: :data:`~mhaspec.spec.variants.VARIANTS`), ``framework``.  The
judging side (mhaspec.conformance) and the adapters both import this module;
neither imports the other.  :func:`describe_adapter` is what a worker tells the
runner about its adapter (the ``ready`` message of docs/protocol.md); :func:`cache_dir`
and its helpers (end of this module) are where an adapter keeps what it can rebuild.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
import numbers
import os
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import AdapterError
from ..spec import BACKWARD_STAGES, DTYPES, STAGES, Case
from ..spec.stages import VARIANT_STAGES
from ..spec.variants import VARIANTS
from .ranks import is_distributed

#: The stages a deviation may name: every stage, the variants' too (``q_rot``, ``k_rot``, ``lse``).
DECLARABLE_STAGES: tuple[str, ...] = STAGES + VARIANT_STAGES + BACKWARD_STAGES


@runtime_checkable
class Adapter(Protocol):
    """What the suite needs from an implementation under test."""

    name: str

    def run(self, case: Case) -> Mapping[str, Any]:
        """Compute ``case`` in ``case.dtype``; return ``{"output": …}`` plus any other stages."""
        ...

    # Optional (docs/backward.md): def backward(self, case) -> Mapping[str, Any] — the gradients of
    # L = Σ case.d_output ⊙ output, by backward stage name (d_concat … d_b_o), computed in case.dtype.


@dataclass(frozen=True)
class Deviation:
    """A declared, explained difference from the spec.

    ``case``, ``dtype`` and ``stage`` are shell-style patterns (``fnmatch``),
    or several separated by ``|`` (``stage="head_outputs|d_k_proj"``: one
    declaration, one reason, for the stages one mechanism reaches); a stage
    verdict that fails and matches is reported as ``known deviation`` with
    ``reason`` instead of ``fail``.

    ``rows="fully_masked"`` narrows it to the query rows that see no key (the
    rows where frameworks give uniform or NaN weights): the stage is a known
    deviation only if every element *outside* those rows passes; a failure
    anywhere else is still a failure.  Such a deviation needs no case names.

    ``within`` bounds its size, so that it cannot hide a bug at the same stage:

    * a dtype (``"float32"``): the stage must still pass with that dtype's
      tolerances — for a run that does a step in a narrower dtype than asked
      (a float64 scale or softmax taken in float32);
    * ``"worst-case"``: the stage must still pass the worst-case precision
      contract in its own dtype — for a sum accumulated in the dtype itself
      (a bfloat16 bias gradient summed in bfloat16);
    * a positive finite number (``1e-27``), an absolute bound: every element
      must pass its normal tolerance or have ``|error| <= within`` — for a tiny
      absolute error where the spec has an exact value (PaddlePaddle's CPU
      softmax leaves 1.6e-28 at masked weights, where the spec has 0); the
      elements beyond it are judged as normal (every check).

    Beyond that the stage is a plain failure ("beyond its declared
    deviation").  ``None`` (the default) excuses an error of any size.
    """

    reason: str
    case: str = "*"
    dtype: str = "*"
    stage: str = "*"
    rows: str | None = None
    within: str | float | None = None

    def matches(self, case: str, dtype: str, stage: str) -> bool:
        return match_pattern(case, self.case) and match_pattern(dtype, self.dtype) and match_pattern(stage, self.stage)

    @property
    def pattern(self) -> str:
        rows = f" (rows: {self.rows})" if self.rows else ""
        within = f" (within: {self.within})" if self.within is not None else ""
        return f"{self.case}/{self.dtype}/{self.stage}{rows}{within}"


def match_pattern(name: str, pattern: str) -> bool:
    """Whether ``name`` matches a deviation pattern: shell-style (``fnmatch``), alternatives separated by ``|``."""
    return any(fnmatch.fnmatchcase(name, p) for p in pattern.split("|"))


#: Values of :attr:`Deviation.rows`.
DEVIATION_ROWS = ("fully_masked",)

#: Named values of :attr:`Deviation.within`: a dtype, or the worst-case precision contract (or else
#: a positive finite number: an absolute bound on the error).
DEVIATION_WITHIN = (*DTYPES, "worst-case")


def parse_deviations(declared: Any, where: str = "known_deviations") -> list[Deviation]:
    """Normalise an adapter's ``known_deviations``.

    Accepted: a mapping ``"CASE[/DTYPE[/STAGE]]" -> reason``; or an iterable of
    :class:`Deviation` or of dicts with ``reason`` and optional ``case``,
    ``dtype``, ``stage``, ``rows``, ``within``.  An absolute ``within`` comes back a float.
    """
    if declared is None:
        return []
    out: list[Deviation] = []
    if isinstance(declared, Mapping):
        for key, reason in declared.items():
            parts = str(key).split("/")
            if len(parts) > 3 or not all(parts):
                raise AdapterError(f"{where}: pattern {key!r} is not CASE[/DTYPE[/STAGE]]")
            parts += ["*"] * (3 - len(parts))
            out.append(Deviation(reason=str(reason), case=parts[0], dtype=parts[1], stage=parts[2]))
    elif isinstance(declared, Iterable) and not isinstance(declared, (str, bytes)):
        for item in declared:
            if isinstance(item, Deviation):
                out.append(item)
            elif isinstance(item, Mapping) and "reason" in item:
                try:
                    out.append(Deviation(**dict(item)))
                except TypeError as exc:
                    raise AdapterError(f"{where}: bad entry {item!r} ({exc})") from None
            else:
                raise AdapterError(f"{where}: entry {item!r} is neither a Deviation nor a dict with a reason")
    else:
        raise AdapterError(f"{where}: expected a mapping or a list, got {type(declared).__name__}")
    for i, dev in enumerate(out):
        if dev.rows is not None and dev.rows not in DEVIATION_ROWS:
            raise AdapterError(f"{where}: deviation {dev.pattern}: rows must be one of {DEVIATION_ROWS}")
        if dev.within is not None and not (dev.within in DEVIATION_WITHIN if isinstance(dev.within, str)
                                           else _absolute_bound(dev.within)):
            raise AdapterError(f"{where}: deviation {dev.pattern}: within must be one of "
                               f"{', '.join(DEVIATION_WITHIN)}, or a positive finite number (an absolute bound "
                               f"on |error|, e.g. 1e-27), not {dev.within!r}")
        if dev.within is not None and not isinstance(dev.within, str):
            dev = out[i] = dataclasses.replace(dev, within=float(dev.within))  # (a numpy scalar, an int)
        if dev.within is not None and dev.rows is not None:
            raise AdapterError(f"{where}: deviation {dev.pattern}: rows and within cannot be combined (rows "
                               "already confines it: everything outside those rows must pass)")
        if not dev.reason.strip():
            raise AdapterError(f"{where}: deviation {dev.pattern} has no reason")
        for field, pattern, names in (("stage", dev.stage, DECLARABLE_STAGES), ("dtype", dev.dtype, DTYPES)):
            for alternative in pattern.split("|"):  # each alternative must name something
                if not any(fnmatch.fnmatchcase(n, alternative) for n in names):
                    which = f" {alternative!r}" if "|" in pattern else ""
                    raise AdapterError(f"{where}: deviation {dev.pattern}{which} matches no {field}; "
                                       f"{field}s are {', '.join(names)}")
    return out


def _absolute_bound(within: Any) -> bool:
    """Whether ``within`` is an absolute bound: a positive finite real number (not a bool)."""
    return isinstance(within, numbers.Real) and not isinstance(within, bool) and math.isfinite(within) and within > 0


def adapter_name(adapter: Any) -> str:
    return str(getattr(adapter, "name", type(adapter).__name__))


def adapter_framework(adapter: Any) -> tuple[str | None, str | None]:
    """(framework, its version) as the adapter declares it, for the report's header and matrix.

    ``framework`` names a distribution (``"torch"``); its installed version is looked up
    (``importlib.metadata``, else the imported module's ``__version__``), unless the adapter sets
    ``framework_version`` itself (a string: a framework that is not a distribution, a build of
    one's own).  None where neither finds one (the report shows ``?``)."""
    framework = getattr(adapter, "framework", None)
    declared = getattr(adapter, "framework_version", None)
    if declared is not None and not isinstance(declared, str):
        raise AdapterError(f"adapter {adapter_name(adapter)}: framework_version must be a string, "
                           f"got {type(declared).__name__}")
    if not framework:
        if declared is not None:
            raise AdapterError(f"adapter {adapter_name(adapter)}: framework_version without framework "
                               "(name the framework it is the version of)")
        return None, None
    if declared is not None:
        return str(framework), declared
    from importlib.metadata import PackageNotFoundError, version

    try:
        return str(framework), version(str(framework))
    except PackageNotFoundError:  # e.g. tensorflow installed as tensorflow-cpu: ask the module
        module = sys.modules.get(str(framework).replace("-", "_"))
        found = getattr(module, "__version__", None)
        return str(framework), str(found) if found is not None else None


def adapter_dtypes(adapter: Any) -> tuple[str, ...]:
    """The dtypes the adapter declares (default: all four)."""
    declared = getattr(adapter, "dtypes", None)
    if declared is None:
        return DTYPES
    unknown = [d for d in declared if d not in DTYPES]
    if unknown:
        raise AdapterError(f"adapter {adapter_name(adapter)}: dtypes {unknown} are not among {', '.join(DTYPES)}")
    return tuple(d for d in DTYPES if d in declared)


def adapter_variants(adapter: Any) -> tuple[str, ...]:
    """The attention variants the adapter declares it computes (``variants``; default none), in the order
    of :data:`~mhaspec.spec.variants.VARIANTS`.  A case using another one is reported unsupported."""
    declared = getattr(adapter, "variants", None)
    if declared is None:
        return ()
    if isinstance(declared, str) or not isinstance(declared, Iterable):
        raise AdapterError(f"adapter {adapter_name(adapter)}: variants must be a collection of names among "
                           f"{', '.join(VARIANTS)}, got {declared!r}")
    declared = list(declared)
    unknown = [v for v in declared if v not in VARIANTS]
    if unknown:
        raise AdapterError(f"adapter {adapter_name(adapter)}: variants {unknown} are not among {', '.join(VARIANTS)}")
    return tuple(v for v in VARIANTS if v in declared)


def describe_adapter(adapter: Any) -> dict[str, Any]:
    """What the runner needs to know about an adapter, as JSON-able data (docs/protocol.md, ``ready``)."""
    name = adapter_name(adapter)
    deviations = parse_deviations(getattr(adapter, "known_deviations", None), f"adapter {name}: known_deviations")
    framework, version = adapter_framework(adapter)
    return {
        "name": name,
        "dtypes": list(adapter_dtypes(adapter)),
        "variants": list(adapter_variants(adapter)),
        "deviations": [dataclasses.asdict(d) for d in deviations],
        "framework": framework,
        "framework_version": version,
        "has_supports": getattr(adapter, "supports", None) is not None,
        "has_backward": callable(getattr(adapter, "backward", None)),
        "has_decode": callable(getattr(adapter, "decode", None)),
        # a distributed adapter (run_rank, docs/distributed.md): the launcher that runs its ranks
        **({"distributed": {"launcher": str(getattr(adapter, "launcher", ""))}} if is_distributed(adapter) else {}),
    }


# --- Where an adapter keeps what it can always rebuild -------------------------------------------
#
# Where mhaspec keeps what it can always rebuild, to save the time of rebuilding it.
#
# Two built-in adapters spend most of a catalog run building things that do not
# change from one run to the next: ``torch-onnx`` exports the same modules with
# ``torch.onnx.export`` (about 0.8 s each), the JAX and Flax adapters compile the
# same XLA programs.  Both keep them in a folder of their own under the cache
# directory, keyed by everything that could change them (versions, the source of
# the code that builds them, the case's structure), and rebuild on any doubt:
#
# * ``MHASPEC_CACHE_DIR`` unset: ``$XDG_CACHE_HOME/mhaspec`` (``~/.cache/mhaspec``);
# * ``MHASPEC_CACHE_DIR=PATH``: that folder;
# * ``MHASPEC_CACHE_DIR=off`` (or ``0``, ``none``, ``false``, empty): no cache at all.
#
# What is cached is never judged on trust: a cached ONNX graph is the exporter's
# own output, written as an ONNX file (protobuf; nothing here reads or writes a
# pickle), and a file that cannot be read or does not parse is ignored and
# rebuilt.  A folder that cannot be created or written costs the cache, never the
# run.  Deleting the folder is always safe.

#: The environment variable naming the cache directory (or switching the cache off).
CACHE_ENV = "MHASPEC_CACHE_DIR"

_OFF = {"", "0", "off", "none", "false", "no"}


def cache_root() -> Path | None:
    """The cache directory (not created here), or None when ``MHASPEC_CACHE_DIR`` switches it off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        if value.strip().lower() in _OFF:
            return None
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "mhaspec"


def cache_dir(kind: str) -> Path | None:
    """``<cache root>/<kind>``, created; None when the cache is off or the folder cannot be made."""
    root = cache_root()
    if root is None:
        return None
    folder = root / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def source_digest(*files: str | os.PathLike[str]) -> str:
    """sha256 of the bytes of ``files`` (the code that builds a cached thing), in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def key_digest(*parts: object) -> str:
    """A file-name-safe digest of ``parts`` (their ``repr``s)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def cache_read(path: Path) -> bytes | None:
    """The file's bytes, or None when it is missing or unreadable."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def cache_write(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` atomically (a temporary file beside it, then a rename), so
    that another process never reads half a file; False (and nothing left behind) on failure."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
