"""``Idempotency-Key`` (docs/api.md, "Idempotency"): an in-memory store of finished outcomes.

A key is scoped by the API key that sent it. The fingerprint of a request is its method, path and
the SHA-256 of its raw body. ``claim`` answers one of three ways:

- no entry: the caller now owns a new running entry and must ``succeed`` or ``fail`` it;
- a finished entry with the same fingerprint: its stored outcome, to replay;
- a running entry with the same fingerprint: wait until it ends, then replay it (or, if it
  failed and so stored nothing, claim again and run);
- any entry with another fingerprint: ``idempotency_conflict``.

Only successes are stored (a 2xx response, or a stream's ``AppendResult``), for ``ttl_s`` (24 h).
The store lives in this process's memory: a restart forgets it (a durable store is later work).

Quotas are per API key: each key keeps at most ``max_entries`` outcomes and ``max_bytes`` of them
(bodies, texts, token ids, plus a fixed overhead per entry); beyond either, that key's own oldest
finished outcomes are dropped. One key can therefore never flush another's outcomes (which
would make a retried append run twice), and a key that stays within its quota keeps every
outcome for the whole ``ttl_s``. A running entry is never dropped for space.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from phloem.api.schemas import AppendResult, ErrorCode
from phloem.api.server.errors import ApiError

__all__ = ["IdempotencyStore", "Running", "StoredResponse", "StoredStream", "fingerprint"]

_KEY = re.compile(r"[\x21-\x7e]{1,255}")
# Python objects around one stored outcome (entry, event, dict slot, strings' headers).
_ENTRY_OVERHEAD = 512


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished 2xx response."""

    status: int
    body: bytes
    media_type: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class StoredStream:
    """A finished SSE append, replayed as one delta and its ``done``."""

    result: AppendResult


Outcome = StoredResponse | StoredStream


@dataclass(eq=False)
class Running:
    """A claimed entry; its owner runs the request, then calls ``succeed`` or ``fail``."""

    fingerprint: str
    created_at: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    nbytes: int = 0  # counted against its owner's byte quota once finished


def fingerprint(method: str, path: str, body: bytes) -> str:
    """The request's fingerprint: method, path and the body's SHA-256."""
    return f"{method} {path} {hashlib.sha256(body).hexdigest()}"


class IdempotencyStore:
    """Outcomes by ``(owner, key)``, kept ``ttl_s`` seconds, within per-owner quotas.

    Args:
        ttl_s: How long a finished outcome is replayed.
        max_entries: Entries one owner may keep.
        max_bytes: Bytes of outcomes one owner may keep.
    """

    def __init__(self, ttl_s: float = 86_400.0, max_entries: int = 10_000, max_bytes: int = 64 << 20) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._owners: dict[str, OrderedDict[str, Running]] = {}
        self._bytes: dict[str, int] = {}
        self._next_sweep = 0.0

    @staticmethod
    def check_key(key: str) -> None:
        """Raise ``ApiError`` (``invalid_request``) unless ``key`` is 1-255 visible ASCII chars."""
        if not _KEY.fullmatch(key):
            raise ApiError(ErrorCode.INVALID_REQUEST,
                           "Idempotency-Key: expected 1-255 visible ASCII characters, "
                           f"got {key[:40]!r}")

    async def claim(self, owner: str, key: str, fingerprint: str) -> Running | Outcome:
        """Claim ``key`` for a request, or get the outcome to replay.

        Returns:
            A ``Running`` entry the caller owns, or the stored outcome.

        Raises:
            ApiError: ``idempotency_conflict`` when the key was used with another request.
        """
        while True:
            self._prune(owner)
            entries = self._owners.setdefault(owner, OrderedDict())
            entry = entries.get(key)
            if entry is None:
                entry = Running(fingerprint, time.monotonic())
                entries[key] = entry
                return entry
            if entry.fingerprint != fingerprint:
                raise ApiError(ErrorCode.IDEMPOTENCY_CONFLICT,
                               f"Idempotency-Key {key!r} was already used with another request "
                               "(method, path or body differ)")
            if entry.outcome is not None:
                return entry.outcome
            await entry.done.wait()

    def succeed(self, owner: str, key: str, entry: Running, outcome: Outcome) -> None:
        """Store the outcome of a claimed entry and wake its waiters."""
        entry.outcome = outcome
        entry.nbytes = _size(key, entry.fingerprint, outcome)
        if self._owners.get(owner, {}).get(key) is entry:
            self._bytes[owner] = self._bytes.get(owner, 0) + entry.nbytes
        entry.done.set()
        self._prune(owner)

    def fail(self, owner: str, key: str, entry: Running) -> None:
        """Forget a claimed entry whose request failed (errors are not stored)."""
        entries = self._owners.get(owner)
        if entries is not None and entries.get(key) is entry:
            del entries[key]
        entry.done.set()

    def num_entries(self, owner: str) -> int:
        """Entries ``owner`` keeps (finished and running)."""
        return len(self._owners.get(owner, ()))

    def _prune(self, owner: str) -> None:
        """Drop ``owner``'s expired outcomes, then its oldest finished ones beyond its quota;
        every minute also every other owner's expired ones."""
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + 60.0
            for other in list(self._owners):
                self._drop(other, now - self._ttl_s, over_quota=False)
        self._drop(owner, now - self._ttl_s, over_quota=True)

    def _drop(self, owner: str, deadline: float, over_quota: bool) -> None:
        entries = self._owners.get(owner)
        if entries is None:
            return
        for key, entry in list(entries.items()):
            expired = entry.created_at < deadline
            full = over_quota and (len(entries) > self._max_entries or self._bytes.get(owner, 0) > self._max_bytes)
            if not expired and not full:
                break  # oldest first: the rest are younger and the quota holds
            if entry.outcome is None:
                continue  # never drop a running entry
            del entries[key]
            self._bytes[owner] -= entry.nbytes
        if not entries:
            del self._owners[owner]
            self._bytes.pop(owner, None)


def _size(key: str, fingerprint: str, outcome: Outcome) -> int:
    """Bytes an outcome holds: its body (or result's text and ids), key, fingerprint, overhead."""
    if isinstance(outcome, StoredResponse):
        body = len(outcome.body) + sum(len(k) + len(v) for k, v in outcome.headers)
    else:
        body = len(outcome.result.text.encode()) + 8 * len(outcome.result.output_ids)
    return body + len(key) + len(fingerprint) + _ENTRY_OVERHEAD
