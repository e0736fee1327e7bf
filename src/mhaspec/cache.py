"""Where mhaspec keeps what it can always rebuild, to save the time of rebuilding it.

Two built-in adapters spend most of a catalog run building things that do not
change from one run to the next: ``torch-onnx`` exports the same modules with
``torch.onnx.export`` (about 0.8 s each), the JAX and Flax adapters compile the
same XLA programs.  Both keep them in a folder of their own under the cache
directory, keyed by everything that could change them (versions, the source of
the code that builds them, the case's structure), and rebuild on any doubt:

* ``MHASPEC_CACHE_DIR`` unset: ``$XDG_CACHE_HOME/mhaspec`` (``~/.cache/mhaspec``);
* ``MHASPEC_CACHE_DIR=PATH``: that folder;
* ``MHASPEC_CACHE_DIR=off`` (or ``0``, ``none``, ``false``, empty): no cache at all.

What is cached is never judged on trust: a cached ONNX graph is the exporter's
own output, written as an ONNX file (protobuf; nothing here reads or writes a
pickle), and a file that cannot be read or does not parse is ignored and
rebuilt.  A folder that cannot be created or written costs the cache, never the
run.  Deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

#: The environment variable naming the cache directory (or switching the cache off).
ENV = "MHASPEC_CACHE_DIR"

_OFF = {"", "0", "off", "none", "false", "no"}


def cache_root() -> Path | None:
    """The cache directory (not created here), or None when ``MHASPEC_CACHE_DIR`` switches it off."""
    value = os.environ.get(ENV)
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


def read(path: Path) -> bytes | None:
    """The file's bytes, or None when it is missing or unreadable."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def write(path: Path, data: bytes) -> bool:
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
