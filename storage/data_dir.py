"""The data directory itself: one server at a time, and the server's secret.

- ``lock_data_dir`` creates the directory (mode 0700) if needed and takes an exclusive,
  non-blocking ``flock`` on ``server.lock`` inside it, held until the lock is closed (or the
  process dies: the kernel drops it, so a crash never leaves a stale lock). A second server on
  the same directory would load the same sessions and write the same journal files; it fails
  at start with ``DataDirInUse`` instead. The lock file records the holder's pid, for the message.
- ``server_secret`` is 32 random bytes kept in ``server.secret`` (mode 0600), created on first
  use: the key of the owner-id HMAC (``api._auth``), so a copy of the records alone does not let
  anyone test API-key guesses offline.

Everything created in the data directory is private to the server's user: directories 0700
(``_fs.ensure_dir``), files 0600 (``_fs.atomic_write``).
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from types import TracebackType

from ._fs import atomic_write
from .errors import StorageError, StorageUnavailable

__all__ = ["DataDirInUse", "DataDirLock", "lock_data_dir", "server_secret"]

_LOCK = "server.lock"
_SECRET = "server.secret"


class DataDirInUse(StorageError):
    """Another process holds the data directory's lock."""


class DataDirLock:
    """The exclusive lock of a data directory; ``close`` (or leaving ``with``) releases it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def lock_data_dir(path: Path) -> DataDirLock:
    """Create ``path`` if needed and lock it for this process.

    Raises:
        DataDirInUse: Another process holds it.
        StorageUnavailable: It cannot be created, or is not a writable directory.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StorageUnavailable(f"cannot use {path} as the data directory: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DataDirInUse(f"another phloem server (pid {holder}) uses the data directory {path}; "
                           "give each server its own --data-dir") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DataDirLock(fd)


def server_secret(path: Path) -> bytes:
    """The server's secret in data directory ``path``, created (0600) on first use.

    Raises:
        StorageUnavailable: It cannot be read or written.
    """
    file = path / _SECRET
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = file.read_text().strip()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise StorageUnavailable(f"cannot read {file}: {exc.strerror or exc}") from exc
    if text:
        try:
            value = bytes.fromhex(text)
        except ValueError:
            value = b""
        if len(value) != 32:
            raise StorageUnavailable(f"{file} is not 64 hex digits: restore it, or delete it (every "
                                     "API key then owns new, empty session lists)")
        return value
    value = secrets.token_bytes(32)
    atomic_write(file, lambda tmp: tmp.write_text(value.hex() + "\n"))
    return value
