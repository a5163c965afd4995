"""Pin/TTL policy: a session's head stays pinned in the engine's prefix cache for ``ttl`` seconds.

After every turn (and at creation with content, at fork and at prefetch) the session's new head is
pinned with ``EngineClient.pin_prefix(token_ids)`` (the deepest cached checkpoint within its
tokens; forks of one parent thus pin the very same node), then the old pin is released: new
before old, so the shared prefix is never unpinned in between. The session is ``active``.

A TTL timer (``loop.call_later``) then runs; when it fires, the pin is released and the session
becomes ``idle`` (evictable; ``sessions.tiers.spill`` later moves idle sessions to host and disk). A new
turn re-arms it. A timer that fires while a generation runs re-arms itself (the session is ``active``
and the running request holds the engine's locks anyway); the generation's commit replaces it,
and if the generation fails, the old timer still unpins later. ``ttl == 0`` unpins right after
the turn.

With ``spill_at_release`` set (the spiller's, when ``idle_to_host_s == 0``), a pin that ends
spills the session to host memory first (the spiller unpins it once the copy is placed: no
moment in which it is evictable with no copy); a spill that cannot place its copy leaves it
``idle``. With ``ttl == 0`` that runs just after the turn's commit, as an expiry (an export
reads the turn-end checkpoint, and the client's result does not wait for the copy).

Each activation bumps ``pin_epoch``; an expiry that finds another epoch is stale and does nothing
(timers are cancelled, but a cancelled timer's task may already be queued). Pin changes happen
under ``session.lock``, and engine failures while unpinning are logged, never raised: the worst
case is a prefix that stays evictable-later rather than a request that fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from phloem.engine import EngineError

if TYPE_CHECKING:
    from phloem.runtime import EngineClient
    from phloem.sessions.session import Session, SessionStatus

__all__ = ["PinKeeper"]

logger = logging.getLogger(__name__)

# A zero TTL's expiry that finds its turn still committing looks again this much later.
_BUSY_RETRY_S = 0.02


class PinKeeper:
    """Pins session heads and runs their TTL timers.

    Args:
        engine: The engine client whose prefix cache holds the heads.
    """

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._tasks: set[asyncio.Task[None]] = set()
        # Set by the spiller when sessions spill as their pin ends: moves the session to host and
        # unpins it; False when it did not (the session then becomes ``idle``).
        self.spill_at_release: Callable[[Session], Awaitable[bool]] | None = None

    async def activate(self, session: Session) -> None:
        """Pin the session's current head and (re)start its TTL; call under ``session.lock``."""
        stop_timer(session)
        session.pin_epoch += 1
        old, session.pin = session.pin, None
        if session.token_ids:
            try:
                session.pin = await self._engine.pin_prefix(session.token_ids, session.owner)
            except EngineError as exc:
                logger.warning("pinning session %s failed: %s", session.session_id, exc)
        if old is not None:
            await self._unpin(session.session_id, old)
        session.status = "active"
        session.touched_at = time.monotonic()
        if session.ttl <= 0 and self.spill_at_release is None:
            await self.release(session, "idle")
            return
        epoch = session.pin_epoch
        loop = asyncio.get_running_loop()
        session.ttl_timer = loop.call_later(session.ttl, self._spawn_expiry, session, epoch)

    async def let_go(self, session: Session) -> None:
        """The session's pin ends (TTL over): spilled first where the spiller says so, else
        ``idle``; call under ``session.lock``. An append that starts during the spill's copy
        keeps the pin (its request may already wait with nothing to resume from): the timer
        looks again later, as for a generation running at expiry."""
        if self.spill_at_release is not None and await self.spill_at_release(session):
            return
        if session.busy:
            self._rearm(session, session.pin_epoch)
            return
        await self.release(session, "idle")

    async def release(self, session: Session, status: SessionStatus) -> None:
        """Drop the session's pin and timer and set ``status``; call under ``session.lock``."""
        stop_timer(session)
        session.pin_epoch += 1
        old, session.pin = session.pin, None
        if old is not None:
            await self._unpin(session.session_id, old)
        session.status = status
        session.touched_at = time.monotonic()

    def close(self) -> None:
        """Stop every pending expiry (shutdown: the engine's cache goes away with it)."""
        for task in list(self._tasks):
            task.cancel()

    def _spawn_expiry(self, session: Session, epoch: int) -> None:
        task = asyncio.get_running_loop().create_task(self._expire(session, epoch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire(self, session: Session, epoch: int) -> None:
        async with session.lock:
            if session.pin_epoch != epoch or session.deleted:
                return
            if session.busy:
                self._rearm(session, epoch)
                return
            session.ttl_timer = None
            await self.let_go(session)

    def _rearm(self, session: Session, epoch: int) -> None:
        # A generation runs: its commit re-arms the timer; if it fails, this one must.
        loop = asyncio.get_running_loop()
        session.ttl_timer = loop.call_later(max(session.ttl, _BUSY_RETRY_S), self._spawn_expiry, session, epoch)

    async def _unpin(self, session_id: str, handle: object) -> None:
        try:
            await self._engine.unpin_prefix(handle)
        except EngineError as exc:
            logger.warning("unpinning session %s failed: %s", session_id, exc)


def stop_timer(session: Session) -> None:
    """Cancel the session's TTL timer, if any (its pin stays)."""
    if session.ttl_timer is not None:
        session.ttl_timer.cancel()
        session.ttl_timer = None
