"""Per-key quotas (docs/api.md, "Limits"): sessions held and generations in flight, per owner.

Beyond either quota a request is 429 ``rate_limited`` with ``Retry-After``. The server-wide limit
on generations in flight (503 ``overloaded``) is the sessions layer's admission
(``SessionConfig.max_num_generations``), checked after these.

- **Generations**: an owner's count goes up when the API starts one (an append with
  ``generate`` over HTTP or WebSocket, an OpenAI completion) and down when it settles, whatever
  its outcome. Appends without ``generate`` are not counted (as in the sessions layer).
- **Sessions**: the owner's live sessions as the manager lists them, plus its creates and forks
  still running. Those are reserved before their first ``await``, so concurrent creates cannot
  overshoot the quota together (a create that just finished may briefly count twice: the check
  errs on the side of refusing).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from phloem.api.schemas import ErrorCode
from phloem.api.server.errors import ApiError
from phloem.sessions import SessionManager

__all__ = ["OwnerLimits"]


class OwnerLimits:
    """Counts per owner, checked with no ``await`` between check and count.

    Args:
        manager: Lists an owner's sessions.
        max_sessions: Sessions one owner may hold.
        max_generations: Generations one owner may run at once.
        retry_after_s: The ``retry_after`` of the 429.
    """

    def __init__(self, manager: SessionManager, max_sessions: int, max_generations: int,
                 retry_after_s: float) -> None:
        self._manager = manager
        self._max_sessions = max_sessions
        self._max_generations = max_generations
        self._retry_after_s = retry_after_s
        self._num_creating: Counter[str] = Counter()
        self._num_generations: Counter[str] = Counter()

    def num_generations(self, owner: str) -> int:
        """Generations of ``owner`` in flight."""
        return self._num_generations[owner]

    @contextlib.contextmanager
    def creating_sessions(self, owner: str, n: int) -> Iterator[None]:
        """Reserve ``n`` new sessions of ``owner`` for the duration of a create or fork.

        Raises:
            ApiError: ``rate_limited``: ``owner`` would hold more than ``max_sessions``.
        """
        room = self._max_sessions - self._num_creating[owner] - n
        # NOTE: the manager has no per-owner count: ask for at most `room` sessions and see
        # whether more exist (cost O(room) snapshots, never more than the quota).
        over = room < 0 or self._manager.list_sessions(owner, limit=room)[1]
        if over:
            raise ApiError(ErrorCode.RATE_LIMITED,
                           f"this API key may hold at most {self._max_sessions} sessions; delete "
                           f"some before creating {n} more", self._retry_after_s)
        self._num_creating[owner] += n
        try:
            yield
        finally:
            self._release(self._num_creating, owner, n)

    def acquire_generation(self, owner: str) -> None:
        """Count one more generation of ``owner``; ``release_generation`` when it settles.

        Raises:
            ApiError: ``rate_limited``: ``owner`` already runs ``max_generations``.
        """
        if self._num_generations[owner] >= self._max_generations:
            raise ApiError(ErrorCode.RATE_LIMITED,
                           f"this API key runs {self._num_generations[owner]} generations, the "
                           "most it may run at once; retry when one ends", self._retry_after_s)
        self._num_generations[owner] += 1

    def release_generation(self, owner: str) -> None:
        """Forget one generation of ``owner`` (it settled, or failed to start)."""
        self._release(self._num_generations, owner, 1)

    @staticmethod
    def _release(counts: Counter[str], owner: str, n: int) -> None:
        assert counts[owner] >= n, f"limit accounting: releasing {n} of {counts[owner]} for an owner"
        counts[owner] -= n
        if not counts[owner]:
            del counts[owner]
