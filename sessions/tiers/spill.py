"""Tiered session state: spill idle sessions to host memory, then disk; resume them; recover them.

Policy (docs/architecture.md, "Session state tiers")::

    active ──TTL──▶ idle ──idle_to_host_s──▶ host ──host budget full──▶ disk
      ▲  (pinned)    (unpinned, on the GPU,      (HostPool)               (DiskStore file,
      │               evictable)                                           survives restarts)
      └──────────── append / prefetch: import the segment, pin again ◀──────┘
    active ──TTL, idle_to_host_s == 0: copy, then unpin──▶ host   (no idle window)

- **Spill** (`Spiller.spill`): export the session's deepest cached checkpoint
  (``EngineClient.export_prefix``) into a `storage.Segment` and put it in the host pool (or
  write it to disk), then unpin. The GPU copy stays in the radix cache, unpinned, until the
  engine evicts it for room: spilling is "keep a copy, then let go". If the export is no
  deeper than the segment the session already has, that one is kept. A spill that cannot
  place its segment (to disk, or past the host budget, with the disk unwritable or full; into
  a full host tier with the backlog off and no demotion possible) changes nothing: the session
  stays resident with its status, and the sweeper retries later.
- **Spill at release** (``idle_to_host_s == 0``, `Spiller.spill_at_release`): when a
  session's pin ends, it is spilled to host *before* it is unpinned, so it is never evictable
  without a copy (the ``idle`` window is where an oversubscribed fleet lost state: the engine
  evicted sessions the sweeper had not spilled yet, and their next turn recomputed them). A
  spill that cannot place its segment leaves the session ``idle``, as before.
- **Host budget**: before a segment enters the host pool, the least recently used host
  segments are demoted to disk until it fits; a segment larger than the whole budget goes to
  disk directly. The spill does not wait for those demotions: its segment waits in a bounded
  backlog, readable by resumes, while background writers make its room
  (``sessions.tiers._segments``), so the session is unpinned as soon as its copy exists; with
  the disk a whole backlog behind, the least recently used host segment is dropped instead.
- **Resume** (`Spiller.state_for_append`, before an append's request): if the GPU no longer
  holds the segment's prefix, read it back (host pool or disk, validated: model fingerprint,
  shapes, token-id hash against the session's own tokens) and hand it to the request
  (``EngineClient.generate``'s ``resume``): the engine loads it into the GPU as it admits the
  request, in the request's place in the queue, so the memory a step frees cannot all go to
  the requests queued behind it (a separate import before the request was starved that way
  under load and recomputed), and no hand-off hold waits on an admission. The request then
  computes only what lies past the checkpoint, and waits for room like any request (pinned
  sessions demoted after ``admission_stall_s``). On prefetch (`Spiller.resume`) the state is
  imported at once; with no room it is left to the append. Any failure (missing, corrupt or
  foreign segment) falls back to recomputing from the token history: a turn is never lost,
  and a bad segment is dropped.
- **Forks** of a spilled session share its segment (`SpilledSegment.holders`); the first
  child to append imports it once (``SpilledSegment.lock``), the others then hit the cache.
  A segment is deleted when its last holder lets go (a newer spill, or delete). Demoting a
  shared host segment moves every holder to ``disk``.
- **Pins never deadlock** (`Spiller.relieve`): when a generation has waited
  ``admission_stall_s`` *for memory* (the engine reports its pools full after eviction:
  ``EngineClient.waits_for_memory``), or the engine turns it away for lack of room (it finishes
  at once with ``length`` and no token), the least recently used pinned sessions that are not
  generating (``active`` within their TTL) are spilled to host and unpinned (tiers off: only unpinned; half of them, at
  least one), and the request goes on (or is sent again, relieving each time, until
  ``admission_stall_s`` has passed since the first refusal: then ``Overloaded``; the time it
  queued behind other work before that does not count). Pinned sessions are what the engine cannot evict; idle ones it evicts by
  itself. A request that only waits for its turn behind other prefills demotes nobody.
- **Graceful shutdown** (`Spiller.flush`, ``sessions.tiers._flush``): host segments, then sessions
  only on the GPU, are written to disk within ``shutdown_flush_s``, so they resume from disk.
- **Tiers off** (``SessionConfig.session_tiers`` False): ``spill`` never moves anything, the
  sweeper spills nothing, ``offload`` is a no-op; sessions stay ``idle`` in the prefix cache
  until the engine evicts them, and recompute what it evicted (the stateless baseline).
- **Restart** (`Spiller.recover`): host and GPU state is gone; a journaled session resumes
  from the disk segment its index record names, else from the newest segment in its own
  directory whose token ids are a prefix of its history, else by recompute. Segments of this
  model that no session references any more are deleted.

Under tensor parallelism the engine gathers every rank's shard into the TP=1 layout
(``engine.parallel.state_shards``): segments do not depend on the TP size.

Where segments live and how they move between tiers is ``sessions.tiers._segments``; this module is
the policy. Lock order: ``session.lock`` may be held while taking a ``SpilledSegment.lock``,
never the reverse (segment-lock holders change other sessions' status without their lock: a
status write is a plain assignment, and every reader re-checks it under its own lock).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import torch

from phloem.engine import EngineError
from phloem.runtime import PrefixState
from phloem.sessions._events import SessionEvents
from phloem.sessions.tiers._flush import FlushReport, flush_to_disk
from phloem.sessions.tiers._pins import PinKeeper
from phloem.sessions.tiers._segments import SegmentTiers
from phloem.sessions.config import SessionConfig
from phloem.sessions.session import Session, SessionStatus, SpilledSegment, SpillTier
from phloem.sessions.tiers.store import SessionStore
from phloem.storage import CorruptSegment, HostPool, Segment, SessionRecord, StorageError

if TYPE_CHECKING:
    from phloem.runtime import EngineClient

__all__ = ["Spiller"]

logger = logging.getLogger(__name__)

# Status order: a session is "at or below" a tier when its rank is at least the tier's.
_RANK = {"active": 0, "idle": 1, "host": 2, "disk": 3}


class Spiller:
    """Moves session state between the GPU, host memory and disk (see the module docstring).

    Args:
        engine: The engine client.
        store: The session store (index and segment files).
        pins: Pins and unpins session heads.
        config: Host budget, delays, sweep interval.
        sessions: The manager's live sessions by id (read, never added to or removed from).
        events: Logs and counts spills and resumes (``sessions._events``).
    """

    def __init__(self, engine: EngineClient, store: SessionStore, pins: PinKeeper,
                 config: SessionConfig, sessions: dict[str, Session],
                 events: SessionEvents) -> None:
        self._engine = engine
        self._events = events
        self._store = store
        self._pins = pins
        self._config = config
        self._sessions = sessions
        self._tiers = SegmentTiers(store, config.host_budget_bytes, config.backlog_budget_bytes,
                                   sessions, events, self.spawn, pin_arena=config.session_tiers)
        if config.idle_to_host_s == 0 and config.session_tiers:
            pins.spill_at_release = self.spill_at_release
        self._tasks: set[asyncio.Task[None]] = set()
        self._retry_s = 10 * config.sweep_interval_s

    @property
    def host(self) -> HostPool:
        """The host tier (its ``used_bytes`` stay within ``host_budget_bytes``)."""
        return self._tiers.host

    @property
    def backlog_bytes(self) -> int:
        """Payload bytes of host segments waiting for room in the host tier (``_segments``)."""
        return self._tiers.backlog_bytes

    @property
    def disk_bytes(self) -> int:
        """Payload bytes of the spilled segments on disk (a gauge of the disk tier)."""
        return sum(entry.nbytes for entry in self._tiers.entries() if entry.tier == "disk")

    def start(self) -> None:
        """Start the sweeper (spills idle sessions, probes a degraded index)."""
        self.spawn(self._sweep_forever())

    def close(self) -> None:
        """Stop the sweeper and every move in flight (the host tier dies with the process)."""
        for task in list(self._tasks):
            task.cancel()

    async def flush(self, budget_s: float) -> FlushReport:
        """Stop the sweeper and the moves in flight, then write to disk, within ``budget_s``,
        the state a restart would lose (``sessions.tiers._flush``: host segments, then GPU-only
        sessions, most recently used first)."""
        tasks = list(self._tasks)
        self.close()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await flush_to_disk(self.spill, self._tiers, list(self._sessions.values()), budget_s)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run a move on its own task, kept until it ends."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def recover(self, sessions: list[Session], records: dict[str, SessionRecord]) -> None:
        """Attach each restarted session's disk segment (see "Restart" above)."""
        await self._tiers.recover(sessions, records)

    async def offload(self, session: Session, tier: SpillTier) -> None:
        """Spill ``session`` to ``tier`` now (an explicit offload); a no-op when it is already
        there or lower, deleted or generating."""
        async with session.lock:
            if session.deleted or session.busy or _RANK[session.status] >= _RANK[tier]:
                return
            segment = session.segment
            if session.status == "host" and segment is not None:
                await self._tiers.demote(segment)
                return
            await self.spill(session, tier)

    async def prefetch(self, session: Session) -> None:
        """Load a spilled session's state back to the GPU and pin it (``active``)."""
        async with session.lock:
            if session.deleted or session.busy or session.status == "active":
                return
            await self.resume(session)
            await self._pins.activate(session)

    async def spill(self, session: Session, tier: SpillTier) -> bool:
        """Copy the session's cached state to ``tier`` and unpin it; call under ``session.lock``.

        Returns:
            Whether the session left the GPU's pins (its status is then ``host`` or ``disk``);
            always False with ``SessionConfig.session_tiers`` off.
        """
        if not self._config.session_tiers:
            return False
        old = session.segment
        try:
            state = (await self._engine.export_prefix(session.token_ids, session.owner, self.host.alloc)
                     if session.token_ids else None)
        except EngineError as exc:
            logger.warning("spilling session %s failed: %s", session.session_id, exc)
            return False
        if state is None or (old is not None and state.num_tokens <= old.num_tokens):
            return await self._spill_without_export(session, tier, gpu_has_state=state is not None)
        entry = await self._place_segment(session, state, tier)
        if entry is None:
            session.spill_retry_at = time.monotonic() + self._retry_s
            return False
        return await self._let_go(session, entry.tier)

    async def spill_at_release(self, session: Session) -> bool:
        """``PinKeeper.spill_at_release`` (``idle_to_host_s == 0``): spill a session whose pin
        ends to host (copy, then unpin); False when nothing moved (it then becomes ``idle``)."""
        return bool(session.token_ids) and await self.spill(session, "host")

    async def state_for_append(self, session: Session) -> PrefixState | None:
        """The session's spilled prefix, read back from host or disk for its next request, which
        the engine loads as it admits the request (``EngineClient.generate``'s ``resume``: the
        load takes its place in the queue, so requests queued behind it cannot starve it of
        memory) unless the cache holds that prefix then. A host segment is handed over even
        while the GPU still holds the prefix: unpinned, it may be evicted before the request is
        admitted (reading it back costs nothing); a disk read is skipped then. None when
        nothing was spilled. Counted as a resume once the engine says it loaded it
        (``count_carried``). Never raises: a segment that cannot be read is dropped and the
        request recomputes it."""
        loaded = await self._load(session, unless_on_gpu=False)
        if loaded is None:
            return None
        state, tier, nbytes, seconds = loaded
        session.carried = (tier, nbytes, seconds)
        return state

    def count_carried(self, session: Session, num_resumed_tokens: int) -> None:
        """The session's turn ended: the state its request carried is a resume from its tier
        if the engine loaded it (``num_resumed_tokens`` of the prompt), else the GPU cache
        served that prefix and nothing is counted."""
        carried, session.carried = session.carried, None
        if carried is not None and num_resumed_tokens > 0:
            tier, nbytes, seconds = carried
            self._resumed(session, tier, num_resumed_tokens, nbytes, seconds)

    async def resume(self, session: Session) -> None:
        """Load the session's spilled prefix into the GPU now (``prefetch``: ahead of its next
        append), if the GPU lost it. With no room it is left to the append, which loads it in
        its place in the queue (``state_for_append``). Never raises."""
        loaded = await self._load(session)
        if loaded is None:
            return
        state, tier, nbytes, seconds = loaded
        started = time.perf_counter()
        try:
            if not await self._engine.import_prefix(state, session.owner):
                return
        except (EngineError, ValueError) as exc:
            logger.warning("session %s: import failed (%s); its next turn loads it again", session.session_id, exc)
            return
        self._resumed(session, tier, state.num_tokens, nbytes, seconds + time.perf_counter() - started)

    def _resumed(self, session: Session, tier: str, n: int, nbytes: int, seconds: float) -> None:
        self._events.resumed(session, tier, n, nbytes, seconds)
        # The session's next turn counts these tokens as served by ``tier`` (``sessions._served``).
        session.resumed = (tier, n)

    async def relieve(self, exclude: Session | None = None) -> bool:
        """Free engine memory for a stalled request: spill and unpin the least recently used
        half (at least one) of the pinned sessions that are not generating; with none, have
        sessions whose own next turn waits for admission let go of their pins
        (``_step_aside``). Idle sessions are not touched: they pin nothing, the engine evicts
        them itself. Returns whether any moved."""
        candidates = sorted((s for s in self._sessions.values()
                             if _pinned_and_waiting(s) and s is not exclude),
                            key=lambda s: s.touched_at)
        if not candidates:
            return await self._step_aside(exclude)
        victims = candidates[: max(1, len(candidates) // 2)]
        for session in victims:
            async with session.lock:
                if not _pinned_and_waiting(session):
                    continue
                logger.info("engine short of memory: demoting pinned session %s", session.session_id)
                if not await self.spill(session, "host") and not session.busy:
                    # (An append that started during the copy owns the pin now: its request
                    # may already wait with nothing to resume from, so the pin stays.)
                    await self._pins.release(session, "idle")
        return bool(victims)

    async def _step_aside(self, exclude: Session | None) -> bool:
        """The pins left belong to sessions whose next turn is itself waiting for admission (an
        agent back from its tool within the TTL): such turns could wait on each other's pins
        for ever, nothing running and nothing to demote. The least recently used half of them
        (at least one) let go of their pins; with tiers on each first copies its head to host
        and hands it to its waiting request, which loads it back as the engine admits it
        (``Generation.carry``), so its turn still skips the prefill. Returns whether any moved."""
        waiting = sorted((s for s in self._sessions.values()
                          if s.pin is not None and s.busy and s.generation is not None and s.generation.waiting
                          and not s.deleted and s is not exclude),
                         key=lambda s: s.touched_at)
        moved = False
        for session in waiting[: max(1, len(waiting) // 2)]:
            async with session.lock:
                generation = session.generation
                if session.pin is None or generation is None or not generation.waiting or session.deleted:
                    continue
                status: SessionStatus = "idle"
                if self._config.session_tiers:
                    try:
                        state = await self._engine.export_prefix(session.token_ids, session.owner, self.host.alloc)
                    except EngineError:
                        continue
                    if state is None or not await generation.carry(state):
                        continue
                    entry = await self._place_segment(session, state, "host")
                    if entry is not None:
                        status = entry.tier
                    session.carried = ("host", entry.nbytes if entry is not None else 0, 0.0)
                logger.info("engine short of memory: session %s lets go of its pin while its turn waits",
                            session.session_id)
                await self._pins.release(session, status)
                moved = True
        return moved

    def inherit(self, child: Session, parent: Session) -> bool:
        """Give a fork of a spilled parent the parent's segment (when it covers no more than the
        child's tokens) and status. Returns False when the parent is on the GPU."""
        if parent.status not in ("host", "disk"):
            return False
        entry = parent.segment
        if entry is not None and entry.num_tokens <= len(child.token_ids):
            child.segment = entry
            entry.holders.add(child.session_id)
            child.status = entry.tier
        else:
            child.status = "disk"
        return True

    async def forget(self, session: Session) -> None:
        """Release a deleted session's segment (deleted with its last holder), and its
        directory unless a fork still resumes from a file in it."""
        entry, session.segment = session.segment, None
        if entry is not None:
            await self._tiers.release(session.session_id, entry)
        if not self._tiers.owns_any(session.session_id):
            await self._tiers.quietly(self._tiers.disk.delete_session, session.session_id)

    async def sweep(self) -> None:
        """One sweeper pass: spill sessions idle for ``idle_to_host_s``; probe a degraded index."""
        now = time.monotonic()
        for session in list(self._sessions.values()) if self._config.session_tiers else ():
            if not self._due(session, now):
                continue
            async with session.lock:
                if self._due(session, now):
                    await self.spill(session, "host")
        await self._store.probe_index(
            lambda: [s for s in self._sessions.values() if not s.deleted])

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.sweep_interval_s)
            try:
                await self.sweep()
            except Exception:
                logger.exception("the spill sweeper failed; it runs again in %.1f s",
                                 self._config.sweep_interval_s)

    def _due(self, session: Session, now: float) -> bool:
        return (session.status == "idle" and not session.busy and not session.deleted
                and bool(session.token_ids) and now >= session.spill_retry_at
                and now - session.touched_at >= self._config.idle_to_host_s)

    async def _spill_without_export(self, session: Session, tier: SpillTier,
                                    gpu_has_state: bool) -> bool:
        """Nothing newer to export: keep the segment the session has, or record that its state
        is gone (``disk``: recompute), or leave it ``idle`` (exports unsupported here)."""
        entry = session.segment
        if entry is not None:
            if tier == "disk" and not await self._tiers.demote(entry):
                return False
            return await self._let_go(session, entry.tier)
        if gpu_has_state or await self._gpu_holds(session) > 0:
            session.spill_retry_at = time.monotonic() + self._retry_s
            return False
        return await self._let_go(session, "disk")

    async def _let_go(self, session: Session, status: SessionStatus) -> bool:
        """Unpin and take the spilled status, unless an append started during the move (it
        owns the pin and the status now; the segment stays as its fallback)."""
        if session.busy or session.deleted:
            return False
        await self._pins.release(session, status)
        await self._store.set_tier(session)
        self._events.spilled(session, status)
        return True

    async def _place_segment(self, session: Session, state: PrefixState, tier: SpillTier) -> SpilledSegment | None:
        """Place ``state`` in ``tier`` (or on disk, past the host budget) as the session's
        segment; None when it forms no segment or no tier takes it."""
        segment = self._segment(session, state)
        entry = await self._tiers.place(segment, tier) if segment is not None else None
        if entry is not None:
            await self._tiers.hold(session, entry)
        return entry

    def _segment(self, session: Session, state: PrefixState) -> Segment | None:
        try:
            return Segment.from_tensors(
                session_id=session.session_id, segment_id=f"seg_{secrets.token_hex(12)}",
                model_fingerprint=self._store.fingerprint,
                tensors={"kv": state.kv, "conv": state.conv, "ssm": state.ssm,
                         "token_ids": torch.tensor(state.token_ids, dtype=torch.int64)})
        except ValueError as exc:
            logger.warning("session %s: exported state does not form a segment: %s",
                           session.session_id, exc)
            return None

    async def _load(self, session: Session, unless_on_gpu: bool = True) -> tuple[PrefixState, str, int, float] | None:
        """Read the session's segment back (host or disk, validated) unless the GPU holds its
        prefix (``unless_on_gpu``; else a host segment is read regardless): ``(state, tier,
        bytes, seconds)``, or None (nothing to load, or it could not be read: then dropped, and
        the request recomputes it)."""
        entry = session.segment
        if entry is None or entry.num_tokens > len(session.token_ids):
            return None
        n = entry.num_tokens
        # Unsettled: the session's last turn ended before it was spilled, so no checkpoint landing
        # next step is its own; a resume does not wait a step for other requests' turn ends.
        if (unless_on_gpu or entry.tier != "host") and await self._gpu_holds(session, n, settled=False) >= n:
            return None
        started = time.perf_counter()
        async with entry.lock:
            try:
                segment = await self._tiers.load(entry, session.token_ids)
            except (StorageError, ValueError) as exc:
                logger.warning("session %s: cannot resume segment %s (%s); recomputing it",
                               session.session_id, entry.segment_id, exc)
                self._events.resume_failed()
                await self._tiers.drop(entry, delete_file=isinstance(exc, CorruptSegment))
                return None
        tensors = segment.tensors
        state = PrefixState(tuple(session.token_ids[:n]), tensors["kv"], tensors["conv"], tensors["ssm"])
        return state, entry.tier, entry.nbytes, time.perf_counter() - started

    async def _gpu_holds(self, session: Session, up_to: int | None = None, settled: bool = True) -> int:
        """Tokens of the session the engine holds in its owner's namespace (at most ``up_to``)."""
        # Token 0 stands for "one more token": the query then matches at most ``up_to`` tokens.
        token_ids = session.token_ids if up_to is None else [*session.token_ids[:up_to], 0]
        try:
            return await self._engine.cached_prefix_len(token_ids, session.owner, settled=settled) if token_ids else 0
        except EngineError:
            return 0


def _pinned_and_waiting(session: Session) -> bool:
    return session.pin is not None and not session.busy and not session.deleted
