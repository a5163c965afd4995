"""Durable session records: the journal (source of truth) and the index, written at each turn end.

Every change that a caller is told about (create, a committed turn, a patch, a fork) is written
to ``storage.SessionJournal`` (one fsynced JSON file per session under ``data_dir``) and to the
index (``SQLiteIndex`` at ``data_dir/index.sqlite`` by default, ``RedisIndex`` when
``redis_url`` is set) *before* the in-memory session changes, so an acknowledged turn is never
lost and a failed write commits nothing. Deletes remove both.

The record's ``data`` is this module's JSON (``_FORMAT``): token ids, turns, chat context,
metadata, TTL, parent and fork point. At startup ``load`` reads the journal back: sessions of
the same model fingerprint come back with status ``disk`` (their state is gone; the next append
recomputes it from the tokens); records of another model are skipped, and left on disk.

The index's ``tier`` is ``"gpu"`` for sessions in memory and ``"none"`` after a restart; the
host/disk tiers belong to spill/resume, a later issue. Blocking I/O runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from phloem.sessions.errors import GenerationFailed
from phloem.sessions.session import Session, Turn
from phloem.storage import (
    RedisIndex, SessionIndex, SessionJournal, SessionRecord, SQLiteIndex, StorageError, Tier,
)

__all__ = ["SessionStore", "model_fingerprint"]

logger = logging.getLogger(__name__)
_FORMAT = 1


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
    """Writes and reads session records (journal + index).

    Args:
        data_dir: Where the journal lives (``data_dir/sessions/*.json``).
        fingerprint: The served model's ``model_fingerprint``.
        redis_url: The Redis index, or None for the embedded SQLite index.

    Raises:
        StorageError: The journal directory or the index cannot be opened.
    """

    def __init__(self, data_dir: Path, fingerprint: str, redis_url: str | None = None) -> None:
        self._journal = SessionJournal(data_dir)
        self._index: SessionIndex = (
            RedisIndex(redis_url) if redis_url is not None else SQLiteIndex(data_dir / "index.sqlite"))
        self._fingerprint = fingerprint

    def close(self) -> None:
        """Close the index connection."""
        self._index.close()

    async def write(self, session: Session, tier: Tier = "gpu") -> None:
        """Durably write the session's record (journal first, then index).

        Raises:
            GenerationFailed: A write failed; the journal still holds the previous record.
        """
        record = self._record(session, tier)
        try:
            await asyncio.to_thread(self._write_sync, record)
        except StorageError as exc:
            raise GenerationFailed(f"could not persist session {session.session_id}: {exc}") from exc

    async def delete(self, session_id: str) -> None:
        """Forget a session in the journal and the index.

        Raises:
            GenerationFailed: The journal file could not be removed.
        """
        try:
            await asyncio.to_thread(self._delete_sync, session_id)
        except StorageError as exc:
            raise GenerationFailed(f"could not delete session {session_id}: {exc}") from exc

    def load(self) -> list[Session]:
        """Read back every journaled session of this model (status ``disk``), oldest first.

        Unreadable records and records of another model are logged and skipped. The index is
        refreshed with what was loaded (tier ``none``: nothing survives a restart but tokens).
        """
        sessions = []
        for record in self._journal.scan():
            if record.model_fingerprint != self._fingerprint:
                logger.warning("session %s belongs to model %s, not %s: not loaded",
                               record.session_id, record.model_fingerprint, self._fingerprint)
                continue
            try:
                session = _decode(record)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("session %s has an unreadable record: %s", record.session_id, exc)
                continue
            try:
                self._index.put_session(record)
            except StorageError as exc:
                logger.warning("index update for session %s failed: %s", record.session_id, exc)
            sessions.append(session)
        return sorted(sessions, key=lambda s: s.session_id)

    def _write_sync(self, record: SessionRecord) -> None:
        self._journal.write(record)
        self._index.put_session(record)

    def _delete_sync(self, session_id: str) -> None:
        self._journal.delete(session_id)
        try:
            self._index.delete_session(session_id)
        except StorageError as exc:
            # The journal is the source of truth: a stale index entry is rebuilt from it.
            logger.warning("index delete of session %s failed: %s", session_id, exc)

    def _record(self, session: Session, tier: Tier) -> SessionRecord:
        return SessionRecord(
            session_id=session.session_id, owner=session.owner,
            model_fingerprint=self._fingerprint, num_tokens=len(session.token_ids),
            last_used=time.time(), data=json.dumps(_encode(session), separators=(",", ":")),
            tier=tier)


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
                   t.num_chat_messages, t.chat_open] for t in session.turns],
        "chat_messages": session.chat_messages,
        "tools": session.tools,
    }


def _decode(record: SessionRecord) -> Session:
    data = json.loads(record.data)
    if data["format"] != _FORMAT:
        raise ValueError(f"format {data['format']!r}, expected {_FORMAT}")
    turns = [Turn(i, start, end, num_output, reason, created_at, num_chat, bool(chat_open))
             for i, (start, end, num_output, reason, created_at, num_chat, chat_open)
             in enumerate(data["turns"])]
    tools = data["tools"]
    return Session(
        session_id=record.session_id, owner=record.owner, created_at=int(data["created_at"]),
        metadata=dict(data["metadata"]), ttl=float(data["ttl"]),
        token_ids=[int(t) for t in data["token_ids"]], turns=turns,
        chat_messages=list(data["chat_messages"]),
        tools=tuple(tools) if tools is not None else None, parent_id=data["parent_id"],
        fork_turn=data["fork_turn"], status="disk")
