"""Offload and prefetch: the tier moves a client asks for, scoped by owner.

``SessionManager`` inherits ``TierMoves``, so ``offload`` and ``prefetch`` are its methods; they
use its ``_get`` (the owner-scoped look-up) and ``_spill`` (the ``Spiller``). What a move does,
and the tier policy, are ``sessions.tiers.spill``'s. Decision: a mixin rather than a helper object, so
the two methods and their docstrings stay on ``SessionManager`` while ``sessions.manager`` keeps
to the session lifecycle.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from phloem.sessions.errors import SessionBusy

if TYPE_CHECKING:
    from phloem.sessions.session import Session, SessionSnapshot, SpillTier
    from phloem.sessions.tiers.spill import Spiller

__all__ = ["TierMoves"]


class TierMoves:
    """``SessionManager.offload`` and ``SessionManager.prefetch`` (a mixin of the manager)."""

    if TYPE_CHECKING:
        _spill: Spiller

        def _get(self, owner: str, session_id: str) -> Session: ...

    async def offload(self, owner: str, session_id: str, tier: SpillTier = "host", *,
                      wait: bool = False) -> SessionSnapshot:
        """Spill the session's state to ``tier`` and unpin it, in the background.

        A session already at or below ``tier`` is left as it is; a ``host`` session asked for
        ``disk`` moves its segment (with every fork that shares it). When the state cannot be
        stored (disk unwritable or full), nothing changes: the session stays resident.

        Args:
            owner: The owner.
            session_id: The session.
            tier: ``"host"`` or ``"disk"``.
            wait: Return after the move instead of at once.

        Returns:
            The session as of acceptance (as of the end of the move with ``wait``).

        Raises:
            SessionNotFound: No such session of this owner.
            SessionBusy: A generation runs on the session.
        """
        session = self._get(owner, session_id)
        if session.busy:
            raise SessionBusy(f"session {session_id} is generating; offload it after its done")
        move = self._spill.spawn(self._spill.offload(session, tier))
        if wait:
            await asyncio.shield(move)
        return session.snapshot()

    async def prefetch(self, owner: str, session_id: str, *, wait: bool = False) -> SessionSnapshot:
        """Load a spilled session's state back to the GPU and pin it for its TTL (``active``),
        in the background; an ``active`` session is left as it is.

        Args:
            owner: The owner.
            session_id: The session.
            wait: Return after the load instead of at once.

        Returns:
            The session as of acceptance (as of the end of the load with ``wait``).

        Raises:
            SessionNotFound: No such session of this owner.
        """
        session = self._get(owner, session_id)
        if session.status != "active":
            move = self._spill.spawn(self._spill.prefetch(session))
            if wait or session.status == "idle":
                await asyncio.shield(move)
        return session.snapshot()
