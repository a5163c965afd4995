"""`SessionIndex` on Redis, for deployments where several processes or machines share sessions.

Keys (``p`` is the prefix, default ``phloem:``)::

    p session:<session_id>   hash   owner, model_fingerprint, num_tokens, last_used, data, tier,
                                    segment_id (absent when the session has no segment)
    p sessions               set    every session id
    p owner:<owner>          set    the owner's session ids

Decisions: every multi-key update is one ``MULTI``/``EXEC`` under ``WATCH`` of the session hash,
so a record and its set memberships never disagree and `set_tier` never resurrects a session a
concurrent `delete_session` removed. Listing reads the id set, then the hashes in one pipeline,
and drops ids whose hash vanished in between. Floats are stored as ``repr`` (exact round trip).
`clear` deletes only keys under this index's prefix, so tests and tenants can share a server.
Every ``redis.RedisError`` (refused connection, timeout, server error) becomes
`IndexUnavailable`; `health` pings and returns ``False`` instead of raising.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import redis
from redis.client import Pipeline
from redis.typing import EncodableT, FieldT

from .errors import IndexUnavailable
from .index import SessionIndex
from .record import SessionRecord, Tier, check_tier

__all__ = ["RedisIndex"]


class RedisIndex(SessionIndex):
    """The session index in Redis.

    Args:
        url: A redis-py URL, e.g. ``redis://host:6379/0``.
        prefix: Namespace for every key this index touches.
        timeout_s: Connect and per-command socket timeout.

    Raises:
        ValueError: ``prefix`` is empty or ``url`` is not a Redis URL.
    """

    def __init__(self, url: str, prefix: str = "phloem:", *, timeout_s: float = 5.0) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty str, got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self._client = redis.Redis.from_url(
            url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._all_key = f"{prefix}sessions"

    def _session_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{session_id}"

    def _owner_key(self, owner: str) -> str:
        return f"{self.prefix}owner:{owner}"

    @contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as e:
            raise IndexUnavailable(f"Redis index at {self._client_address()} failed: {e}") from e

    def _client_address(self) -> str:
        kwargs = self._client.connection_pool.connection_kwargs
        return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"

    def _transaction(self, body: Callable[[Pipeline], bool], key: str) -> bool:
        # WATCH key, run body (which reads, then queues commands after MULTI), EXEC; redis-py
        # retries on a concurrent write. Its stubs type the callable as returning None, hence
        # the value travels back through ``outcome``.
        outcome: list[bool] = []

        def run(pipe: Pipeline) -> None:
            outcome[:] = [body(pipe)]

        self._client.transaction(run, key)
        return outcome[0]

    def put_session(self, record: SessionRecord) -> None:
        key = self._session_key(record.session_id)
        fields: dict[FieldT, EncodableT] = {
            "owner": record.owner,
            "model_fingerprint": record.model_fingerprint,
            "num_tokens": record.num_tokens,
            "last_used": repr(float(record.last_used)),
            "data": record.data,
            "tier": record.tier,
        }
        if record.segment_id is not None:
            fields["segment_id"] = record.segment_id

        def txn(pipe: Pipeline) -> None:
            old_owner = cast("str | None", pipe.hget(key, "owner"))
            pipe.multi()
            if old_owner is not None and old_owner != record.owner:
                pipe.srem(self._owner_key(old_owner), record.session_id)
            pipe.delete(key)
            pipe.hset(key, mapping=fields)
            pipe.sadd(self._all_key, record.session_id)
            pipe.sadd(self._owner_key(record.owner), record.session_id)

        with self._guard():
            self._client.transaction(txn, key)

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._guard():
            fields = cast("dict[str, str]", self._client.hgetall(self._session_key(session_id)))
        return self._to_record(session_id, fields) if fields else None

    def delete_session(self, session_id: str) -> bool:
        key = self._session_key(session_id)

        def txn(pipe: Pipeline) -> bool:
            owner = cast("str | None", pipe.hget(key, "owner"))
            pipe.multi()
            pipe.delete(key)
            pipe.srem(self._all_key, session_id)
            if owner is not None:
                pipe.srem(self._owner_key(owner), session_id)
            return owner is not None

        with self._guard():
            return self._transaction(txn, key)

    def list_sessions(self, owner: str | None = None) -> list[SessionRecord]:
        set_key = self._all_key if owner is None else self._owner_key(owner)
        with self._guard():
            session_ids = sorted(cast("set[str]", self._client.smembers(set_key)))
            pipe = self._client.pipeline(transaction=False)
            for session_id in session_ids:
                pipe.hgetall(self._session_key(session_id))
            hashes = pipe.execute()
        pairs = zip(session_ids, cast("list[dict[str, str]]", hashes), strict=True)
        records = [self._to_record(session_id, h) for session_id, h in pairs if h]
        return [r for r in records if owner is None or r.owner == owner]

    def set_tier(self, session_id: str, tier: Tier, *, segment_id: str | None = None) -> bool:
        check_tier(tier, segment_id)
        key = self._session_key(session_id)

        def txn(pipe: Pipeline) -> bool:
            exists = bool(pipe.exists(key))
            pipe.multi()
            if exists:
                pipe.hset(key, "tier", tier)
                if segment_id is None:
                    pipe.hdel(key, "segment_id")
                else:
                    pipe.hset(key, "segment_id", segment_id)
            return exists

        with self._guard():
            return self._transaction(txn, key)

    def health(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def clear(self) -> None:
        # Glob metacharacters in the prefix are escaped so clear never reaches past it.
        pattern = re.sub(r"([\\*?\[\]])", r"\\\1", self.prefix) + "*"
        with self._guard():
            batch: list[str] = []
            for key in self._client.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) == 500:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

    def close(self) -> None:
        self._client.close()

    def _to_record(self, session_id: str, fields: dict[str, str]) -> SessionRecord:
        try:
            return SessionRecord(
                session_id=session_id,
                owner=fields["owner"],
                model_fingerprint=fields["model_fingerprint"],
                num_tokens=int(fields["num_tokens"]),
                last_used=float(fields["last_used"]),
                data=fields["data"],
                tier=cast(Tier, fields["tier"]),
                segment_id=fields.get("segment_id"),
            )
        except (KeyError, ValueError) as e:
            raise IndexUnavailable(f"malformed Redis record for session {session_id!r}: {e}") from e
