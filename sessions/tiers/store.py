"""Durable session records: the journal (source of truth) and the index, written at each turn end.

Every change that a caller is told about (create, a committed turn, a patch, a fork) is written
to ``storage.SessionJournal`` (one fsynced JSON file per session under ``data_dir``) *before*
the in-memory session changes, so an acknowledged turn is never lost and a failed write commits
nothing. Deletes remove the journal file. Spilled segments live in ``storage.DiskStore`` at
``data_dir/segments`` (``disk``), which this store owns for ``sessions.tiers.spill``.

The index (``SQLiteIndex`` at ``data_dir/index.sqlite`` by default, ``RedisIndex`` when
``redis_url`` is set) records where each session's state lives: ``gpu`` (``active``/``idle``),
``host`` or ``disk`` with the segment id, ``none`` (to be recomputed). It is best effort: the
journal and the self-describing segment files can rebuild it. When it fails (Redis unreachable
at start or mid-run), the store is *degraded*: ``index_problem`` says why (``/health`` reports
it), sessions keep working on the journal, index writes are skipped (not retried one by one,
which would stall every turn on a timeout), and ``probe_index`` (run by the spill sweeper)
rewrites every live session's record once the index answers again.

Index operations run one at a time, in order, on a chain of tasks (``_queue``); a commit waits
for its own index write at most ``_INDEX_WAIT_S`` (a healthy index answers well within it),
so a hung index (a stopped Redis answers nothing until its socket timeout) never holds a turn
back: the write finishes or fails behind the commit, and once the index is degraded the writes
queued behind it are skipped at once. ``probe_index`` pings without waiting on that queue, then
queues the resync, which builds its records from the sessions as they are *when its turn comes*
and only then reports the index healthy: a turn committed meanwhile is written after it (never
overwritten by an older record), and ``/health`` never says ``ok`` before the index holds every
live session.

A failed journal write degrades the store too (``problem``: ``/health`` says ``degraded``)
until a write succeeds again. Messages that reach clients or ``/health`` name the data
directory ``<data-dir>``, never its absolute path.

The record's ``data`` is this module's JSON (``_FORMAT``): token ids, turns, chat context,
metadata, TTL, parent and fork point. At startup ``load`` reads the journal back: sessions of
the same model fingerprint come back with status ``disk`` (``sessions.tiers.spill`` then attaches
their disk segment, if any; else the next append recomputes them from the tokens); records of
another model are skipped, and left on disk. An empty index (e.g. Redis restarted without
persistence) is rebuilt from the data directory first (``SessionIndex.rebuild_from``).
Blocking I/O runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from phloem.sessions.errors import GenerationFailed
from phloem.sessions.session import Session, Turn
from phloem.sessions.tiers._io import DURABLE
from phloem.sessions.text.tool_parsers import ParsedToolCall
from phloem.storage import (
    DiskStore, RedisIndex, SessionIndex, SessionJournal, SessionRecord, SQLiteIndex, StorageError,
    Tier,
)

__all__ = ["SessionStore", "model_fingerprint", "placement"]

logger = logging.getLogger(__name__)
_FORMAT = 1
# A commit waits this long at most for its index write (which goes on behind it).
_INDEX_WAIT_S = 0.05


def model_fingerprint(model_dir: str | Path) -> str:
    """Identify a model folder by name and the hash of its config and tokenizer files.

    Args:
        model_dir: A Hugging Face model folder.

    Returns:
        ``"<folder name>@sha256:<16 hex>"``; token ids are only meaningful for the same value.
    """
    folder = Path(model_dir)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = folder / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b""))
    return f"{folder.name}@sha256:{digest.hexdigest()[:16]}"


class SessionStore:
    """Writes and reads session records (journal + index) and owns the segment store.

    Args:
        data_dir: Where the journal (``sessions/``) and segments (``segments/``) live.
        fingerprint: The served model's ``model_fingerprint``.
        redis_url: The Redis index, or None for the embedded SQLite index.
        redis_prefix: Namespace of the Redis index's keys.

    Raises:
        StorageError: The journal or segment directory, or the SQLite index, cannot be opened.
    """

    def __init__(self, data_dir: Path, fingerprint: str, redis_url: str | None = None,
                 redis_prefix: str = "phloem:") -> None:
        self._journal = SessionJournal(data_dir)
        self.disk = DiskStore(data_dir / "segments")
        self._index: SessionIndex = (
            RedisIndex(redis_url, prefix=redis_prefix) if redis_url is not None
            else SQLiteIndex(data_dir / "index.sqlite"))
        self._fingerprint = fingerprint
        self._index_problem: str | None = None
        self._journal_problem: str | None = None
        self._deleted_while_degraded: set[str] = set()
        self._index_tail: asyncio.Task[None] | None = None
        self._paths = sorted({str(data_dir), str(data_dir.resolve())}, key=len, reverse=True)

    @property
    def fingerprint(self) -> str:
        """The served model's fingerprint (segments of another model are foreign)."""
        return self._fingerprint

    @property
    def index_problem(self) -> str | None:
        """Why the index is degraded, or None while it answers."""
        return self._index_problem

    @property
    def problem(self) -> str | None:
        """Why the store is degraded (journal writes failing, index unreachable), or None."""
        return "; ".join(p for p in (self._journal_problem, self._index_problem) if p) or None

    def close(self) -> None:
        """Close the index connection."""
        self._index.close()

    async def write(self, session: Session) -> None:
        """Durably write the session's record (journal first, then index, best effort).

        Raises:
            GenerationFailed: The journal write failed; it still holds the previous record.
        """
        record = self._record(session)
        try:
            await DURABLE.run(self._journal.write, record)
        except StorageError as exc:
            raise self._journal_failed(f"could not persist session {session.session_id}", exc) from exc
        self._journal_problem = None
        await self._index_write("write", self._index.put_session, record)

    async def set_tier(self, session: Session) -> None:
        """Record where the session's state lives now (index only, best effort)."""
        tier, segment_id = placement(session)
        await self._index_write("set_tier", self._index.set_tier, session.session_id, tier,
                                segment_id=segment_id)

    async def delete(self, session_id: str) -> None:
        """Forget a session in the journal and the index.

        Raises:
            GenerationFailed: The journal file could not be removed.
        """
        try:
            await DURABLE.run(self._journal.delete, session_id)
        except StorageError as exc:
            raise self._journal_failed(f"could not delete session {session_id}", exc) from exc

        async def delete() -> None:
            if not await DURABLE.run(self._index_call, "delete", self._index.delete_session, session_id):
                self._deleted_while_degraded.add(session_id)
        await asyncio.wait({self._queue(delete)}, timeout=_INDEX_WAIT_S)

    def load(self) -> tuple[list[Session], dict[str, SessionRecord]]:
        """Read back every journaled session of this model (status ``disk``) and the index.

        Unreadable records and records of another model are logged and skipped. An empty index
        is rebuilt from the data directory first; an unreachable one degrades the store.

        Returns:
            The sessions, in id order, and the index's records by session id (empty when the
            index is unreachable).
        """
        sessions = []
        for record in self._journal.scan():
            if record.model_fingerprint != self._fingerprint:
                logger.warning("session %s belongs to model %s, not %s: not loaded",
                               record.session_id, record.model_fingerprint, self._fingerprint)
                continue
            try:
                sessions.append(_decode(record))
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("session %s has an unreadable record: %s", record.session_id, exc)
        try:
            records = self._index.list_sessions()
            if not records and sessions:
                report = self._index.rebuild_from(self.disk, self._journal)
                logger.info("the session index was empty: rebuilt from %s (%s)",
                            self.disk.root.parent, report)
                records = self._index.list_sessions()
        except StorageError as exc:
            self._degrade("load", exc)
            records = []
        return sorted(sessions, key=lambda s: s.session_id), {r.session_id: r for r in records}

    async def sync_index(self, sessions: list[Session]) -> None:
        """Write every session's record to the index (after startup)."""
        records = [self._record(s) for s in sessions]
        await self._queue(lambda: DURABLE.run(self._index_call, "sync", self._put_all, records))

    async def probe_index(self, live: Callable[[], list[Session]]) -> bool:
        """If degraded, ping the index (without waiting on queued index writes) and, once it
        answers, queue a rewrite of every live session's record (``live()``, read when the
        rewrite's turn comes); the store is healthy again only when that rewrite has succeeded.
        Returns whether the index is ok."""
        if self._index_problem is None:
            return True
        if not await DURABLE.run(self._index.health):
            return False

        async def resync() -> None:
            if self._index_problem is None:
                return
            records = [self._record(s) for s in live()]
            logger.info("the session index answers again: resyncing %d session(s)", len(records))
            try:
                await DURABLE.run(self._put_all, records)
            except StorageError as exc:
                self._degrade("sync", exc)
                return
            self._index_problem = None
        await self._queue(resync)
        return self._index_problem is None

    def _put_all(self, records: list[SessionRecord]) -> None:
        """Apply the deletes missed while degraded, then write ``records`` (worker thread)."""
        for session_id in list(self._deleted_while_degraded):
            self._index.delete_session(session_id)
            self._deleted_while_degraded.discard(session_id)
        for record in records:
            self._index.put_session(record)

    def _queue(self, job: Callable[[], Awaitable[object]]) -> asyncio.Task[None]:
        """Run ``job`` after every index operation queued before it."""
        previous = self._index_tail

        async def run() -> None:
            if previous is not None:
                await asyncio.wait({previous})
            await job()
        task = asyncio.get_running_loop().create_task(run())
        self._index_tail = task
        return task

    async def _index_write(self, what: str, fn: Callable[..., object], *args: object,
                           **kwargs: object) -> None:
        """Queue ``_index_call`` (in a worker thread) and wait for it ``_INDEX_WAIT_S`` at most."""
        task = self._queue(lambda: DURABLE.run(self._index_call, what, fn, *args, **kwargs))
        await asyncio.wait({task}, timeout=_INDEX_WAIT_S)

    async def drain_index(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the queued index operations."""
        if self._index_tail is not None:
            await asyncio.wait({self._index_tail}, timeout=timeout_s)

    def _journal_failed(self, what: str, exc: StorageError) -> GenerationFailed:
        """Degrade, log ``exc`` in full, and return the client's error (no server path in it)."""
        logger.error("%s: %s", what, exc)
        detail = self._scrub(str(exc))
        self._journal_problem = f"the session journal cannot be written (sessions cannot change): {detail}"
        return GenerationFailed(f"{what}: {detail}")

    def _scrub(self, text: str) -> str:
        """``text`` with the data directory's absolute path replaced by ``<data-dir>``."""
        for path in self._paths:
            text = text.replace(path, "<data-dir>")
        return text

    def _index_call(self, what: str, fn: Callable[..., object], *args: object,
                    **kwargs: object) -> bool:
        """Run one index operation unless degraded; degrade on failure. Returns whether it ran."""
        if self._index_problem is not None:
            return False
        try:
            fn(*args, **kwargs)
        except StorageError as exc:
            self._degrade(what, exc)
            return False
        return True

    def _degrade(self, what: str, exc: StorageError) -> None:
        if self._index_problem is None:
            logger.warning("session index failed (%s); serving from the journal: %s", what, exc)
        self._index_problem = ("session index unavailable (sessions are served from the journal): "
                               f"{self._scrub(str(exc))}")

    def _record(self, session: Session) -> SessionRecord:
        tier, segment_id = placement(session)
        return SessionRecord(
            session_id=session.session_id, owner=session.owner,
            model_fingerprint=self._fingerprint, num_tokens=len(session.token_ids),
            last_used=time.time(), data=json.dumps(_encode(session), separators=(",", ":")),
            tier=tier, segment_id=segment_id)


def placement(session: Session) -> tuple[Tier, str | None]:
    """The index tier and segment of a session: ``gpu`` while ``active``/``idle``, the segment's
    tier when spilled, ``none`` when its state is gone (resumed by recompute)."""
    if session.status not in ("host", "disk"):
        return "gpu", None
    segment = session.segment
    return ("none", None) if segment is None else (segment.tier, segment.segment_id)


def _encode(session: Session) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "created_at": session.created_at,
        "metadata": session.metadata,
        "ttl": session.ttl,
        "parent_id": session.parent_id,
        "fork_turn": session.fork_turn,
        "token_ids": session.token_ids,
        "turns": [[t.start, t.end, t.num_output_tokens, t.finish_reason, t.created_at,
                   t.num_chat_messages, t.chat_open, [[c.id, c.name, c.arguments] for c in t.tool_calls],
                   t.num_cached_tokens, t.view]
                  for t in session.turns],
        "chat_messages": session.chat_messages,
        "tools": session.tools,
    }


def _decode(record: SessionRecord) -> Session:
    data = json.loads(record.data)
    if data["format"] != _FORMAT:
        raise ValueError(f"format {data['format']!r}, expected {_FORMAT}")
    # Older records have seven fields a turn (before tool calls) or eight (before the cached
    # count and the view).
    turns = [Turn(i, start, end, num_output, reason, created_at, num_chat, bool(chat_open),
                  tuple(ParsedToolCall(*c) for c in (rest[0] if rest else ())),
                  int(rest[1]) if len(rest) > 1 else 0, rest[2] if len(rest) > 2 else None)
             for i, (start, end, num_output, reason, created_at, num_chat, chat_open, *rest)
             in enumerate(data["turns"])]
    tools = data["tools"]
    return Session(
        session_id=record.session_id, owner=record.owner, created_at=int(data["created_at"]),
        metadata=dict(data["metadata"]), ttl=float(data["ttl"]),
        token_ids=[int(t) for t in data["token_ids"]], turns=turns,
        chat_messages=list(data["chat_messages"]),
        tools=tuple(tools) if tools is not None else None, parent_id=data["parent_id"],
        fork_turn=data["fork_turn"], status="disk")
