"""Replacing a folder atomically: a reader sees the old folder or the new one, never half of one.

:func:`replace_folder` writes the new folder beside the old one (``.NAME.new-*``,
the file named ``last`` written last, every file fsync'ed) and swaps it in with
one atomic exchange of the two directories (Linux ``renameat2(RENAME_EXCHANGE)``).
Where the exchange is not available it falls back to two renames, and the next
call restores the old folder if a kill fell between them.  Concurrent calls in
the same parent folder are serialised by a lock (``flock`` on the parent folder);
stale ``.NAME.new-*`` and ``.NAME.old-*`` folders left by killed runs are removed.

What may be replaced is the caller's to say (``check``): mhaspec.fixtures replaces
only an empty folder or a golden folder it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path


def replace_folder(folder: Path, files: Mapping[str, bytes], check: Callable[[Path], None] | None = None,
                   last: str | None = None) -> None:
    """Replace ``folder`` with exactly ``files`` (name -> bytes), atomically, under the parent's lock.

    ``check(folder)``, called under the lock after stale staging folders are dealt
    with, raises if ``folder`` must not be replaced.  ``last``: the file written
    last (a manifest, so that a folder holding it is complete).  OS errors propagate.
    """
    folder = Path(folder).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(folder.parent):
        _recover(folder)
        if check is not None:
            check(folder)
        _swap_in(folder, files, last)


@contextlib.contextmanager
def folder_lock(parent: Path) -> Iterator[None]:
    """An exclusive lock on the folder ``parent`` (released by the OS if the process dies)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _staging_folders(folder: Path, kind: str) -> list[Path]:
    return sorted(folder.parent.glob(f".{folder.name}.{kind}-*"), key=lambda p: p.stat().st_mtime)


def _recover(folder: Path) -> None:
    """Under the lock: bring back a folder lost between two renames, then remove stale staging folders."""
    old = _staging_folders(folder, "old")
    if not folder.exists() and old:
        os.replace(old.pop(), folder)  # the most recent complete folder
    for stale in old + _staging_folders(folder, "new"):
        shutil.rmtree(stale, ignore_errors=True)


def _swap_in(folder: Path, files: Mapping[str, bytes], last: str | None) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new-", dir=folder.parent))
    try:
        for name in sorted(files, key=lambda n: n == last):  # `last` last
            with open(staging / name, "wb") as fh:
                fh.write(files[name])
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(staging, 0o755)
        _fsync_dir(staging)
        if not folder.exists():
            os.replace(staging, folder)
        elif not _exchange(staging, folder):  # staging now holds the old folder, removed below
            backup = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            backup.rmdir()
            os.replace(folder, backup)
            try:
                os.replace(staging, folder)
            except BaseException:
                os.replace(backup, folder)
                raise
            shutil.rmtree(backup, ignore_errors=True)
        _fsync_dir(folder.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the file system cannot: fall back
        return False
    raise OSError(err, os.strerror(err), str(b))
