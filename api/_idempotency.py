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
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from phloem.api._errors_http import ApiError
from phloem.api.schemas import AppendResult, ErrorCode

__all__ = ["IdempotencyStore", "Running", "StoredResponse", "StoredStream", "fingerprint"]

_KEY = re.compile(r"[\x21-\x7e]{1,255}")


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


def fingerprint(method: str, path: str, body: bytes) -> str:
    """The request's fingerprint: method, path and the body's SHA-256."""
    return f"{method} {path} {hashlib.sha256(body).hexdigest()}"


class IdempotencyStore:
    """Outcomes by ``(owner, key)``, kept ``ttl_s`` seconds (at most ``max_entries``, oldest
    dropped first).

    Args:
        ttl_s: How long a finished outcome is replayed.
        max_entries: Bound on the entries kept in memory.
    """

    def __init__(self, ttl_s: float = 86_400.0, max_entries: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], Running] = OrderedDict()

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
        scope = (owner, key)
        while True:
            self._prune()
            entry = self._entries.get(scope)
            if entry is None:
                entry = Running(fingerprint, time.monotonic())
                self._entries[scope] = entry
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
        entry.done.set()

    def fail(self, owner: str, key: str, entry: Running) -> None:
        """Forget a claimed entry whose request failed (errors are not stored)."""
        if self._entries.get((owner, key)) is entry:
            del self._entries[(owner, key)]
        entry.done.set()

    def _prune(self) -> None:
        deadline = time.monotonic() - self._ttl_s
        while self._entries:
            scope, oldest = next(iter(self._entries.items()))
            if oldest.created_at >= deadline and len(self._entries) < self._max_entries:
                return
            if oldest.outcome is None and oldest.created_at >= deadline:
                return  # never drop a running entry for space
            del self._entries[scope]
