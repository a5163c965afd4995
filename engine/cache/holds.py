"""Hand-off holds: a checkpoint stays locked between the moment it is published for a known next
user and the moment that user locks it.

Two hand-offs leave a checkpoint unlocked for a while, and under memory pressure — running
requests and pinned sessions holding the rest of the pools — eviction takes exactly those
checkpoints first, as they are the only unlocked ones:

- a session's turn ends in the engine (its turn-end checkpoint is published one step after its
  last token) before the sessions layer commits it and pins the new head (``Engine.pin_prefix``):
  evicted in between, the session pins nothing, spills nothing, and its next turn recomputes its
  whole history. A request added with ``hold_turn_end`` (the sessions layer sets it on appends)
  holds the checkpoint its release publishes;
- a spilled session's prefix is imported (``Engine.import_prefix``) just before the request that
  resumes on it is added; evicted in between, that request recomputes what was just copied in.
  Every import holds the checkpoint it publishes.

A hold ends when the next user locks the node — a pin (``Engine.pin_prefix``) or a request
admitted on it (``CacheManager.admit``): ``release`` — or after ``hold_s`` (``expire``, every
step: a commit or request that never comes, a prefetch whose append comes late). A node held
twice holds two locks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from phloem.engine.cache.radix import RadixCache, RadixNode

__all__ = ["HandoffHolds"]


class HandoffHolds:
    """Locks on checkpoints awaiting their next user, released by that user's lock or after ``hold_s``.

    Args:
        tree: The radix cache whose nodes are locked (None: no prefix cache, so nothing is ever
            held, as nothing is published).
        hold_s: The longest a hold lasts.
        clock: Monotonic seconds (tests pass their own).
    """

    def __init__(self, tree: RadixCache | None, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._tree = tree
        self._hold_s = hold_s
        self._clock = clock
        self._held: deque[tuple[float, RadixNode]] = deque()  # in deadline order: one hold_s for all

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, node: RadixNode) -> None:
        """Lock ``node`` for its next user, for at most ``hold_s``."""
        assert self._tree is not None, "a hold needs the prefix cache"
        self._tree.lock(node)
        self._held.append((self._clock() + self._hold_s, node))

    def release(self, node: RadixNode) -> bool:
        """Drop one hold of ``node`` (its next user has locked it); False when none is held."""
        for i, (_, held) in enumerate(self._held):
            if held is node:
                del self._held[i]
                self._unlock(node)
                return True
        return False

    def clear(self) -> None:
        """Drop every hold (tests that count free pages after an import no request followed)."""
        while self._held:
            self._unlock(self._held.popleft()[1])

    def expire(self) -> None:
        """Drop the holds older than ``hold_s``."""
        now = self._clock()
        while self._held and self._held[0][0] <= now:
            self._unlock(self._held.popleft()[1])

    def _unlock(self, node: RadixNode) -> None:
        assert self._tree is not None  # held only where hold() locked it
        self._tree.unlock(node)
