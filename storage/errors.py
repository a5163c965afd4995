"""One shallow error hierarchy for the storage package.

Every failure that crosses the package boundary is a `StorageError`, so callers (the sessions
layer) can map the whole family to "state unavailable, recompute" with one ``except``. Causes
(``OSError``, ``redis.RedisError``, ``sqlite3.Error``) are chained with ``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "CorruptRecord",
    "CorruptSegment",
    "IndexUnavailable",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
]


class StorageError(Exception):
    """Base class of every error raised by ``phloem.storage``."""


class StorageFull(StorageError):
    """A tier has no room for the item; the caller decides what to demote or drop."""


class StorageUnavailable(StorageError):
    """The disk tier cannot be written or read (permissions, disk full, I/O error)."""


class IndexUnavailable(StorageError):
    """The session index (Redis or SQLite) cannot be reached or answered with an error."""


class CorruptSegment(StorageError):
    """A segment file failed validation: wrong model, tampered token ids, bad shapes, truncation."""


class CorruptRecord(StorageError):
    """A journaled session record is not valid JSON of the expected form."""
