"""Fork: ``n`` child sessions holding a parent's committed turns ``0..at_turn``.

A child copies the parent's token ids, turns and chat context up to the fork turn and is pinned
at its head: in the engine it shares the parent's cached prefix (a fork of a spilled parent
shares its segment instead, ``Spiller.inherit``). The children are stored all or none: when one
record cannot be written, those already written are removed and no child is kept.
``SessionManager.fork`` is the owner-scoped entry point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phloem.sessions.errors import GenerationFailed, InvalidInput
from phloem.sessions.session import Session

if TYPE_CHECKING:
    from phloem.sessions.tiers._pins import PinKeeper
    from phloem.sessions.tiers.spill import Spiller
    from phloem.sessions.tiers.store import SessionStore

__all__ = ["commit_children", "make_children"]

logger = logging.getLogger(__name__)


def make_children(parent: Session, owner: str, n: int, at_turn: int | None,
                  new_id: Callable[[], str]) -> tuple[list[Session], int | None]:
    """Build (not store) ``n`` children of ``parent`` holding its turns ``0..at_turn``.

    Args:
        parent: The session forked.
        owner: The children's owner.
        n: How many children.
        at_turn: The last turn they hold (None: all).
        new_id: Makes session ids.

    Returns:
        The children, and the fork turn (None when the parent has no turn).

    Raises:
        InvalidInput: ``at_turn`` is not a committed turn, or ``n`` < 1.
    """
    if n < 1:
        raise InvalidInput(f"n: expected >= 1, got {n}")
    num_turns = len(parent.turns)
    if at_turn is not None and not 0 <= at_turn < num_turns:
        held = f"0..{num_turns - 1}" if num_turns else "it has none yet: leave at_turn out"
        raise InvalidInput(f"at_turn: expected a committed turn of session {parent.session_id} "
                           f"({held}), got {at_turn}")
    last = num_turns - 1 if at_turn is None else at_turn
    turns = parent.turns[: last + 1]
    end = turns[-1].end if turns else 0
    num_chat = turns[-1].num_chat_messages if turns else 0
    now = int(time.time())
    children = [Session(new_id(), owner, now, dict(parent.metadata), parent.ttl,
                        token_ids=parent.token_ids[:end], turns=list(turns),
                        chat_messages=parent.chat_messages[:num_chat], tools=parent.tools,
                        parent_id=parent.session_id, fork_turn=last if turns else None)
                for _ in range(n)]
    return children, last if turns else None


async def commit_children(children: list[Session], parent: Session, store: SessionStore,
                          spill: Spiller, pins: PinKeeper, sessions: dict[str, Session]) -> None:
    """Store the children and add them to ``sessions``, all or none; pin those on the GPU.

    Args:
        children: From ``make_children``.
        parent: Their parent (a spilled parent's segment is shared with them).
        store: Where their records are written.
        spill: The tiers (inherit a spilled parent's segment, or forget it on failure).
        pins: Pins the children that are on the GPU.
        sessions: The manager's sessions by id.

    Raises:
        GenerationFailed: A child's record could not be written (no child is kept).
    """
    spilled = [spill.inherit(child, parent) for child in children]
    written: list[Session] = []
    try:
        for child in children:
            await store.write(child)
            written.append(child)
    except GenerationFailed:
        for child in written:
            await _forget_quietly(store, child.session_id)
        for child in children:
            await spill.forget(child)
        raise
    for child, is_spilled in zip(children, spilled, strict=True):
        sessions[child.session_id] = child
        if not is_spilled:
            async with child.lock:
                await pins.activate(child)


async def _forget_quietly(store: SessionStore, session_id: str) -> None:
    try:
        await store.delete(session_id)
    except GenerationFailed as exc:
        logger.warning("could not remove the record of session %s: %s", session_id, exc)
