"""Filesystem helpers shared by the disk store and the journal: id checks and atomic writes.

Ids become path components, so they are *checked*, never rewritten: an id is 1-128 characters of
``[A-Za-z0-9_-]`` or it is rejected with ``ValueError``. That alphabet has no ``.``, ``/``, NUL or
separator, so ``..``, absolute paths and hidden names cannot be expressed; rewriting instead
(e.g. replacing bad characters) would let two distinct ids collide on one file.

Atomic write protocol (POSIX)::

    1. write the payload to  <dir>/.<name>.<random>.tmp   (same dir, so rename stays on one fs)
    2. fsync the temp file                                 (data reaches the disk)
    3. os.replace(temp, final)                             (readers see old or new, never half)
    4. fsync <dir>                                         (the rename itself is durable)

Directories are created 0700 and files 0600: they hold users' conversations. Any ``OSError``
before step 3 unlinks the temp file, so a failed write leaves no partial file and
an existing final file untouched. Temp names start with ``.``, which no valid id does, so scans
can tell them apart from finished files and `remove_temp_files` can sweep leftovers of a crash
(including the library's own ``.tmpXXXXXX`` files, should safetensors' writer be killed).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from .errors import StorageUnavailable

__all__ = ["MAX_ID_LEN", "atomic_write", "check_id", "ensure_dir", "fsync_dir", "remove_temp_files"]

MAX_ID_LEN = 128
_ID_RE = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_ID_LEN}}}")


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is safe as a single path component, else raise ``ValueError``."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise ValueError(
            f"{what} must be 1-{MAX_ID_LEN} characters of [A-Za-z0-9_-], got {value!r:.80}"
        )
    return value


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> bool:
    """Create ``path`` (and parents) durably if missing; return whether it was created.

    Raises:
        StorageUnavailable: the directory cannot be created.
    """
    if path.is_dir():
        return False
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StorageUnavailable(f"cannot create directory {path}: {e}") from e
    try:
        fsync_dir(path.parent)
    except OSError as e:
        # Best effort: a directory whose creation may not be durable is not left behind.
        with suppress(OSError):
            path.rmdir()
        raise StorageUnavailable(f"cannot create directory {path}: {e}") from e
    return True


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write_tmp: Callable[[Path], None]) -> None:
    """Create or replace ``path`` atomically; ``write_tmp(tmp)`` writes the payload to ``tmp``.

    Raises:
        StorageUnavailable: wrapping the ``OSError`` raised by any step; no temp file remains.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        try:
            write_tmp(tmp)
            # Records and segments hold users' conversations: private to the server's user.
            os.chmod(tmp, 0o600)
            _fsync_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
    except OSError as e:
        raise StorageUnavailable(f"cannot write {path}: {e}") from e


def remove_temp_files(directory: Path) -> int:
    """Delete temp files a crashed writer left in ``directory``; return how many were removed."""
    removed = 0
    for entry in directory.glob(".*"):
        if entry.is_file():
            entry.unlink(missing_ok=True)
            removed += 1
    return removed
