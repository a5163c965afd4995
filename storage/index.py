"""The session index: which session's state lives where, behind one interface, two backends.

`SessionIndex` is a small ABC (one level of inheritance) rather than a ``Protocol`` because
`rebuild_from` is shared behaviour written once on top of the abstract operations. Backends:
`SQLiteIndex` (embedded default, this module) and ``RedisIndex`` (``redis_index.py``) for
deployments of several processes or machines. Both raise `IndexUnavailable` when the backing
store fails and keep `SessionRecord`'s tier/segment invariant; `list_sessions` is ordered by
session id on both so callers see the same answer from either.

SQLite decisions: one connection opened with ``check_same_thread=False`` and guarded by a lock
(the index is touched by the API loop and the engine thread, and every operation is a single
short statement, so a per-thread connection pool buys nothing); WAL so readers in other
processes never block the writer; ``synchronous=FULL`` so an acknowledged update survives power
loss (the journal is the durable source, but a stale index after a crash would need a rebuild).
"""

from __future__ import annotations

import abc
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import IndexUnavailable
from .record import SessionRecord, Tier, check_tier

if TYPE_CHECKING:
    from .disk import DiskStore
    from .journal import SessionJournal
    from .segment import SegmentMeta

__all__ = ["RebuildReport", "SQLiteIndex", "SessionIndex"]


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What `SessionIndex.rebuild_from` restored."""

    num_sessions: int
    num_on_disk: int
    num_orphan_segments: int


class SessionIndex(abc.ABC):
    """Where each session's state lives; see `SessionRecord` for the fields."""

    @abc.abstractmethod
    def put_session(self, record: SessionRecord) -> None:
        """Insert or replace the record of ``record.session_id``."""

    @abc.abstractmethod
    def get_session(self, session_id: str) -> SessionRecord | None:
        """The session's record, or ``None`` if unknown."""

    @abc.abstractmethod
    def delete_session(self, session_id: str) -> bool:
        """Forget a session; return whether it was known."""

    @abc.abstractmethod
    def list_sessions(self, owner: str | None = None) -> list[SessionRecord]:
        """All sessions, or those of ``owner``, ordered by session id."""

    @abc.abstractmethod
    def set_tier(self, session_id: str, tier: Tier, *, segment_id: str | None = None) -> bool:
        """Move a session's state to ``tier``; return ``False`` if the session is unknown.

        Raises:
            ValueError: ``tier`` is invalid or ``segment_id`` does not match it.
        """

    @abc.abstractmethod
    def health(self) -> bool:
        """Whether the backing store answers; never raises."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget every session."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection."""

    def rebuild_from(self, disk: DiskStore, journal: SessionJournal) -> RebuildReport:
        """Replace the index's contents with what the data directory describes.

        Every journaled session is restored with tier ``'disk'`` when a segment of the same
        model exists for it (the newest by ``created_at`` wins), else ``'none'`` (resume by
        recompute). Host and GPU state does not survive a restart, so no other tier is restored.
        Segments without a journaled session are counted as orphans and left alone.

        Raises:
            IndexUnavailable: the index cannot be written.
        """
        newest: dict[str, SegmentMeta] = {}
        for meta in disk.scan():
            best = newest.get(meta.session_id)
            key = (meta.created_at, meta.num_tokens)
            if best is None or key > (best.created_at, best.num_tokens):
                newest[meta.session_id] = meta
        self.clear()
        num_sessions = num_on_disk = 0
        for record in journal.scan():
            found = newest.pop(record.session_id, None)
            if found is not None and found.model_fingerprint == record.model_fingerprint:
                record = replace(record, tier="disk", segment_id=found.segment_id)
                num_on_disk += 1
            self.put_session(record)
            num_sessions += 1
        return RebuildReport(num_sessions, num_on_disk, num_orphan_segments=len(newest))


_COLUMNS = (
    "session_id", "owner", "model_fingerprint", "num_tokens",
    "last_used", "data", "tier", "segment_id",
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    model_fingerprint TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    last_used REAL NOT NULL,
    data TEXT NOT NULL,
    tier TEXT NOT NULL CHECK (tier IN ('gpu', 'host', 'disk', 'none')),
    segment_id TEXT
);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions (owner);
PRAGMA user_version = 1;
"""
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM sessions"
_UPSERT = (
    f"INSERT OR REPLACE INTO sessions ({', '.join(_COLUMNS)}) "
    f"VALUES ({', '.join('?' * len(_COLUMNS))})"
)


class SQLiteIndex(SessionIndex):
    """The embedded index: one SQLite database file (WAL).

    Args:
        path: Database file, created if missing (``":memory:"`` for a private in-memory index).

    Raises:
        IndexUnavailable: the database cannot be opened or initialised.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                # Created private (0600); SQLite gives its -wal and -shm files the same mode.
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            self._conn = sqlite3.connect(
                self.path, timeout=10.0, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as e:
            raise IndexUnavailable(f"cannot open SQLite index {self.path}: {e}") from e
        with self._cursor() as cur:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.executescript(_SCHEMA)

    @contextmanager
    def _cursor(self) -> Iterator[sqlite3.Cursor]:
        with self._lock:
            try:
                cur = self._conn.cursor()
                try:
                    yield cur
                finally:
                    cur.close()
            except sqlite3.Error as e:
                raise IndexUnavailable(f"SQLite index {self.path} failed: {e}") from e

    def put_session(self, record: SessionRecord) -> None:
        values = tuple(getattr(record, c) for c in _COLUMNS)
        with self._cursor() as cur:
            cur.execute(_UPSERT, values)

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._cursor() as cur:
            row = cur.execute(f"{_SELECT} WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else SessionRecord(*row)

    def delete_session(self, session_id: str) -> bool:
        with self._cursor() as cur:
            cur.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
            return cur.rowcount > 0

    def list_sessions(self, owner: str | None = None) -> list[SessionRecord]:
        with self._cursor() as cur:
            if owner is None:
                cur.execute(f"{_SELECT} ORDER BY session_id")
            else:
                cur.execute(f"{_SELECT} WHERE owner = ? ORDER BY session_id", (owner,))
            rows = cur.fetchall()
        return [SessionRecord(*row) for row in rows]

    def set_tier(self, session_id: str, tier: Tier, *, segment_id: str | None = None) -> bool:
        check_tier(tier, segment_id)
        with self._cursor() as cur:
            cur.execute(
                "UPDATE sessions SET tier = ?, segment_id = ? WHERE session_id = ?",
                (tier, segment_id, session_id),
            )
            return cur.rowcount > 0

    def health(self) -> bool:
        try:
            with self._cursor() as cur:
                cur.execute("SELECT 1").fetchone()
        except IndexUnavailable:
            return False
        return True

    def clear(self) -> None:
        with self._cursor() as cur:
            cur.execute("DELETE FROM sessions")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
