"""Where spilled segments live: the host pool and the disk store, behind one registry.

``SegmentTiers`` owns every `SpilledSegment` (a segment plus the sessions that resume from it)
and the mechanics ``sessions.tiers.spill`` builds its policy on: place a new segment (making room in
the host pool by demoting its least recently used segments to disk), demote, load (validated),
drop, and find each restarted session's disk segment. It never pins, unpins or talks to the
engine.

Invariant: a session whose status is ``host`` or ``disk`` and that holds a segment has
``status == segment.tier``; demoting or dropping a segment updates its holders (and their index
records) in the same step.

**The backlog** (write-behind): a host segment that does not fit in the host pool now is not
waited for. It is registered at once (tier ``host``, readable by resumes) in the *backlog*, host
memory it already occupies (the engine's export copied it there), and up to ``SEGMENTS.workers``
writers demote the pool's least recently used segments to disk in the background until it fits,
oldest first. So a spill unpins its session as soon as its copy exists, and the GPU's pools never
wait on the disk (a fleet whose spills waited for their demotion held its GPU pages for the
length of a disk write: docs/benchmarks.md, the 128-agent fleet). The backlog is bounded
(``backlog_bytes`` at most ``backlog_budget_bytes``): when the disk falls that far behind, the
pool's least recently used segment that no writer or reader holds is *dropped* instead (its
holders recompute what it held, counted by ``SessionEvents.segment_dropped``): the GPU's progress
is worth more than the oldest idle state. Only when nothing can be dropped does a spill wait for a
demotion. An empty backlog takes any one segment; a budget of 0 turns the backlog off (every
spill into a full pool waits for its demotion, and nothing is dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from phloem.sessions._events import SessionEvents
from phloem.sessions.session import Session, SpilledSegment, SpillTier
from phloem.sessions.tiers._io import SEGMENTS
from phloem.sessions.tiers.store import SessionStore
from phloem.storage import (
    CorruptSegment, HostPool, Segment, SegmentMeta, SessionRecord, StorageError, hash_token_ids,
)

__all__ = ["SegmentTiers"]

logger = logging.getLogger(__name__)


class SegmentTiers:
    """The registry of spilled segments over the host pool and the disk store.

    Args:
        store: The session store (its ``disk``, fingerprint, and index updates).
        host_budget_bytes: The host pool's byte budget.
        backlog_budget_bytes: Bytes of host segments waiting for room in the pool at most (the
            module docstring's backlog).
        sessions: The manager's live sessions by id (statuses of holders are updated).
        events: Counts the bytes written to each tier, the disk writes and dropped segments.
        spawn: Runs a background task (the backlog's writers) until it ends or the tiers close.
        pin_arena: Pin the host tier's and the backlog's bytes and a quarter more now, where the
            host pool pins (``storage.HostPool``'s arena), for the spills' copies and the disk reads
            (the quarter: the reads in flight, which hold their ranges until their imports' copies
            end, and the ends of the arena's chunks that first fit leaves unused); off when
            nothing spills (``SessionConfig.session_tiers`` off).
    """

    def __init__(self, store: SessionStore, host_budget_bytes: int, backlog_budget_bytes: int,
                 sessions: dict[str, Session], events: SessionEvents,
                 spawn: Callable[[Coroutine[Any, Any, None]], object], pin_arena: bool = True) -> None:
        self._events = events
        self._store = store
        self.disk = store.disk
        held = host_budget_bytes + backlog_budget_bytes
        self.host = HostPool(host_budget_bytes, arena_bytes=held + held // 4 if pin_arena else 0)
        self.backlog_budget_bytes = backlog_budget_bytes
        self._sessions = sessions
        self._segments: dict[str, SpilledSegment] = {}
        self._spawn = spawn
        # The backlog: host segments waiting for room in the pool (readable meanwhile), and the
        # ids no writer has claimed yet, oldest first.
        self._backlog: dict[str, Segment] = {}
        self._unclaimed: deque[str] = deque()
        self._backlog_bytes = 0
        self._writers = 0

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes of host segments waiting for room in the host pool."""
        return self._backlog_bytes

    def entries(self) -> list[SpilledSegment]:
        """Every live segment, in the order they were placed."""
        return list(self._segments.values())

    def owns_any(self, session_id: str) -> bool:
        """Whether a live segment's file lives in this session's directory."""
        return any(e.owner_id == session_id for e in self._segments.values())

    async def place(self, segment: Segment, tier: SpillTier) -> SpilledSegment | None:
        """Put a new segment in the host pool (making room) or on disk; None when neither works.

        A segment larger than the whole host budget goes to disk. A host segment that does not
        fit now waits in the backlog (the module docstring): the call returns without waiting
        for the disk, unless the backlog is full and nothing can be dropped for room.
        """
        meta, nbytes = segment.meta, segment.nbytes
        if tier == "host" and nbytes <= self.host.byte_budget:
            if self._backlog or not self.host.can_store(nbytes):
                if self._backlog_takes(nbytes):
                    return self._enqueue(segment)
                dropped = self.backlog_budget_bytes > 0 and await self._drop_for_room(nbytes)
                if not dropped and not await self._make_room(nbytes):
                    return None
            self.host.put(segment)
        else:
            try:
                await self._write(segment)
            except (StorageError, ValueError) as exc:
                logger.warning("cannot write segment of session %s: %s", meta.session_id, exc)
                return None
            tier = "disk"
        return self._register(segment, tier)

    def _register(self, segment: Segment, tier: SpillTier) -> SpilledSegment:
        meta = segment.meta
        entry = SpilledSegment(meta.segment_id, meta.session_id, meta.num_tokens, segment.nbytes, tier)
        self._segments[meta.segment_id] = entry
        self._events.segment_written(tier, segment.nbytes)
        return entry

    def _backlog_takes(self, nbytes: int) -> bool:
        """Whether a segment may wait in the backlog: within its budget, and an empty backlog
        takes any one segment (a budget smaller than a segment still spares every spill its
        wait); a budget of 0 turns the backlog off."""
        budget = self.backlog_budget_bytes
        return budget > 0 and (not self._backlog or self._backlog_bytes + nbytes <= budget)

    def _enqueue(self, segment: Segment) -> SpilledSegment:
        """Register a host segment in the backlog and make sure writers are making room for it."""
        segment_id = segment.meta.segment_id
        self._backlog[segment_id] = segment
        self._unclaimed.append(segment_id)
        self._backlog_bytes += segment.nbytes
        if self._writers < SEGMENTS.workers:
            self._writers += 1
            self._spawn(self._write_back())
        return self._register(segment, "host")

    def _leave_backlog(self, segment_id: str) -> Segment | None:
        segment = self._backlog.pop(segment_id, None)
        if segment is not None:
            self._backlog_bytes -= segment.nbytes
        return segment

    async def _write_back(self) -> None:
        """A backlog writer: the oldest unclaimed backlog segment gets room in the host pool (its
        least recently used segments demoted to disk), then moves in; until none is left. A disk
        that refuses the demotions stops the writer (its segment stays readable in the backlog;
        the next spill into the backlog starts a writer again)."""
        try:
            while self._unclaimed:
                segment_id = self._unclaimed.popleft()
                segment = self._backlog.get(segment_id)
                if segment is None:
                    continue  # dropped, or demoted by an offload or the shutdown flush
                if not await self._make_room(segment.nbytes):
                    if segment_id in self._backlog:
                        self._unclaimed.appendleft(segment_id)
                    return
                if self._leave_backlog(segment_id) is not None:
                    self.host.put(segment)
        finally:
            self._writers -= 1

    async def _drop_for_room(self, nbytes: int) -> bool:
        """The backlog is full (the disk is behind): drop the host pool's least recently used
        segments that nobody holds the lock of (no demotion or resume reads them) until
        ``nbytes`` fit. On True the caller must ``put`` before its next ``await``."""
        while not self.host.can_store(nbytes):
            victim = next((e for sid in self.host.segment_ids()
                           if (e := self._segments.get(sid)) is not None and not e.lock.locked()), None)
            if victim is None:
                return False
            logger.warning("host tier full and the disk %.0f MiB behind: dropping segment %s (its %d "
                           "tokens are recomputed if its session returns)", self._backlog_bytes / 2**20,
                           victim.segment_id, victim.num_tokens)
            self._events.segment_dropped(victim.nbytes)
            await self.drop(victim, delete_file=False)
        return True

    async def _write(self, segment: Segment) -> None:
        """Write a segment file on the segment pool, timing its parts for ``SessionEvents``: the
        wait for a worker, the write itself, and the wait for the event loop to take it back."""
        submitted = time.perf_counter()

        def write() -> tuple[float, float]:
            started = time.perf_counter()
            self.disk.write(segment)
            return started, time.perf_counter()

        started, ended = await SEGMENTS.run(write)
        self._events.segment_write(segment.nbytes, started - submitted, ended - started,
                                   time.perf_counter() - ended)

    async def demote(self, entry: SpilledSegment) -> bool:
        """Move a host segment to disk; every holder still at ``host`` becomes ``disk``.

        Returns:
            Whether the segment is on disk now (False: the write failed, nothing changed).
        """
        async with entry.lock:
            # ``get`` makes it the most recently used: a writer making room meanwhile demotes
            # another segment, and the two disk writes run side by side. A backlog segment (an
            # offload or the shutdown flush) is written from the backlog.
            segment = self._hosted(entry) if entry.tier == "host" else None
            if segment is None:
                return entry.tier == "disk"
            try:
                await self._write(segment)
            except StorageError as exc:
                logger.warning("cannot demote segment %s to disk: %s", entry.segment_id, exc)
                return False
            self.host.remove(entry.segment_id)
            self._leave_backlog(entry.segment_id)
            entry.tier = "disk"
            self._events.segment_written("disk", entry.nbytes)
            for holder in self._holders(entry):
                if holder.status == "host":
                    holder.status = "disk"
                    await self._store.set_tier(holder)
        return True

    async def hold(self, session: Session, entry: SpilledSegment) -> None:
        """Make ``entry`` the session's segment; its previous one goes with its last holder."""
        old, session.segment = session.segment, entry
        entry.holders.add(session.session_id)
        if old is not None and old is not entry:
            await self.release(session.session_id, old)

    async def release(self, session_id: str, entry: SpilledSegment) -> None:
        """The session lets go of ``entry``; the segment is deleted with its last holder."""
        entry.holders.discard(session_id)
        if not entry.holders:
            await self.drop(entry, delete_file=True)

    async def load(self, entry: SpilledSegment, token_ids: list[int]) -> Segment:
        """Read the segment (host pool or disk) and check it holds the first ``num_tokens`` of
        ``token_ids``; call under ``entry.lock``.

        Raises:
            CorruptSegment: Missing from the host pool, or not this model's or these tokens'.
            StorageUnavailable: The file is missing or unreadable.
        """
        if entry.tier == "host":
            segment = self._hosted(entry)
            if segment is None:
                raise CorruptSegment(f"segment {entry.segment_id} is no longer in the host pool")
        else:
            segment = await SEGMENTS.run(self._read_disk, entry)
        n = entry.num_tokens
        if segment.meta.num_tokens != n or segment.meta.token_ids_hash != hash_token_ids(token_ids[:n]):
            raise CorruptSegment(f"segment {entry.segment_id} does not hold these {n} tokens")
        return segment

    def _hosted(self, entry: SpilledSegment) -> Segment | None:
        """A host segment, from the pool (now the most recently used) or the backlog."""
        return self.host.get(entry.segment_id) or self._backlog.get(entry.segment_id)

    def _read_disk(self, entry: SpilledSegment) -> Segment:
        """Read a segment file, pinned where the host pool pins (in the I/O thread: the engine's
        copy of a pinned state is queued beside its steps, of a pageable one it would block)."""
        segment = self.disk.read(entry.owner_id, entry.segment_id, expect_fingerprint=self._store.fingerprint)
        return segment.on_host(pinned=True, alloc=self.host.alloc) if self.host.pin_memory else segment

    async def drop(self, entry: SpilledSegment, delete_file: bool) -> None:
        """Forget a segment (unusable, or its last holder let go) and free its storage; holders
        at its tier become ``disk`` without a segment (resumed by recompute)."""
        self._segments.pop(entry.segment_id, None)
        for holder in self._holders(entry):
            if holder.segment is entry:
                holder.segment = None
                if holder.status == entry.tier:
                    holder.status = "disk"
                    await self._store.set_tier(holder)
        entry.holders.clear()
        self.host.remove(entry.segment_id)
        self._leave_backlog(entry.segment_id)
        if delete_file:
            await self.quietly(self.disk.delete, entry.owner_id, entry.segment_id)

    async def recover(self, sessions: list[Session], records: dict[str, SessionRecord]) -> None:
        """Attach each restarted session's disk segment and delete this model's segments that
        nothing references (see ``sessions.tiers.spill``, "Restart")."""
        metas = await SEGMENTS.run(self._scan)
        by_owner: dict[str, list[SegmentMeta]] = {}
        for meta in metas.values():
            by_owner.setdefault(meta.session_id, []).append(meta)
        for session in sessions:
            meta = self._pick(session, records.get(session.session_id), metas, by_owner)
            if meta is None:
                continue
            entry = self._segments.get(meta.segment_id)
            if entry is None:
                entry = SpilledSegment(meta.segment_id, meta.session_id, meta.num_tokens,
                                       _payload_bytes(meta), "disk")
                self._segments[meta.segment_id] = entry
            entry.holders.add(session.session_id)
            session.segment = entry
        live = {s.session_id for s in sessions}
        for meta in metas.values():
            # Another model's segments belong to sessions this server does not load: kept.
            ours = meta.model_fingerprint == self._store.fingerprint
            if ours and meta.segment_id not in self._segments:
                await self.quietly(self.disk.delete, meta.session_id, meta.segment_id)
                if meta.session_id not in live:
                    await self.quietly(self.disk.delete_session, meta.session_id)

    async def quietly(self, fn: Callable[..., object], *args: object) -> None:
        """Run a storage cleanup on the segment pool; a failure is logged (it only leaks a file)."""
        try:
            await SEGMENTS.run(fn, *args)
        except (StorageError, ValueError) as exc:
            logger.warning("segment cleanup failed: %s", exc)

    async def _make_room(self, nbytes: int) -> bool:
        """Demote the least recently used host segments until ``nbytes`` fit. On True the
        caller must ``put`` before its next ``await``."""
        while not self.host.can_store(nbytes):
            oldest = self.host.oldest()
            if oldest is None:
                return False
            entry = self._segments.get(oldest.meta.segment_id)
            if entry is None:
                self.host.remove(oldest.meta.segment_id)
            elif not await self.demote(entry):
                return False
        return True

    def _holders(self, entry: SpilledSegment) -> list[Session]:
        return [s for sid in list(entry.holders) if (s := self._sessions.get(sid)) is not None]

    def _scan(self) -> dict[str, SegmentMeta]:
        self.disk.remove_temp_files()
        return {m.segment_id: m for m in self.disk.scan()}

    def _pick(self, session: Session, record: SessionRecord | None, metas: dict[str, SegmentMeta],
              by_owner: dict[str, list[SegmentMeta]]) -> SegmentMeta | None:
        """The segment its index record names, else the newest in its own directory, among
        those of this model that hold a prefix of its tokens."""
        def fits(meta: SegmentMeta) -> bool:
            n = meta.num_tokens
            return (meta.model_fingerprint == self._store.fingerprint
                    and 0 < n <= len(session.token_ids)
                    and meta.token_ids_hash == hash_token_ids(session.token_ids[:n]))

        named = metas.get(record.segment_id) if record and record.segment_id else None
        if named is not None and fits(named):
            return named
        own = sorted(by_owner.get(session.session_id, ()),
                     key=lambda m: (m.created_at, m.num_tokens), reverse=True)
        return next((m for m in own if fits(m)), None)


def _payload_bytes(meta: SegmentMeta) -> int:
    dtypes = meta.expected_dtypes()
    return sum(math.prod(shape) * dtypes[name].itemsize
               for name, shape in meta.expected_shapes().items())
