"""``Session``: one conversation's exact token history, its turns and its lifecycle state.

The token ids are the source of truth: they are what the model conditions on, they are never
re-rendered or re-tokenized, and every turn is a slice of them::

    token_ids: [ turn 0            | turn 1                       | turn 2 ...   ]
                 start=0     end=a   start=a                end=b
                                     [ input (as rendered) | output ]
                                                           |<-- num_output_tokens -->|

A fork copies the parent's turns ``0..at_turn`` and the tokens they cover; in the engine both
sessions then share one cached prefix (nothing is copied there).

``Session`` is the manager's mutable record; callers only ever see the frozen
``SessionSnapshot`` / ``TurnInfo`` it returns.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from phloem.sessions.text.chat import ChatContext
from phloem.sessions.text.tokenizer import Message, ToolSpec
from phloem.sessions.text.tool_parsers import ParsedToolCall

if TYPE_CHECKING:
    from phloem.runtime import PrefixState

__all__ = [
    "FinishReason", "RunningGeneration", "Session", "SessionIdGenerator", "SessionSnapshot",
    "SessionStatus", "SpillTier", "SpilledSegment", "Turn", "TurnInfo",
]

SessionStatus = Literal["active", "idle", "host", "disk"]
FinishReason = Literal["stop", "length", "cancelled"]
SpillTier = Literal["host", "disk"]


class RunningGeneration(Protocol):
    """What a session needs of the generation running on it (``sessions.generation.Generation``):
    a way to stop it, and one to hand its request the session's spilled state while it waits for
    admission. A protocol, so this record stays below ``generation`` (no import cycle)."""

    def cancel(self, *, discard: bool = False) -> None: ...

    @property
    def waiting(self) -> bool: ...  # not admitted yet: no token so far, not finished

    async def carry(self, state: PrefixState) -> bool: ...

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _base32(value: int, num_chars: int) -> str:
    return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in reversed(range(num_chars)))


class SessionIdGenerator:
    """Session ids: ``sess_`` + 10 characters of milliseconds + 26 of 128 random bits.

    Crockford base32 of a big-endian time keeps ids sorting in creation order (the API lists
    newest first by id); the clock part is forced to grow by at least 1 ms per id, so ids made in
    the same millisecond still sort by creation. The random part makes them unguessable.
    """

    def __init__(self) -> None:
        self._last_ms = 0

    def __call__(self) -> str:
        """A new id, greater than every id this generator made before."""
        now_ms = max(time.time_ns() // 1_000_000, self._last_ms + 1)
        self._last_ms = now_ms
        return f"sess_{_base32(now_ms, 10)}{_base32(secrets.randbits(128), 26)}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One committed turn: tokens ``[start, end)``; the last ``num_output_tokens`` were generated.

    ``num_chat_messages`` and ``chat_open`` record the chat context at the turn's end, so a fork
    at this turn renders later messages exactly as the parent would have. ``tool_calls`` are
    the calls parsed from the output (the tokens stay the source of truth).
    ``num_cached_tokens``: of the tokens before the output, those the prefix cache held.
    ``view``: opaque JSON of a protocol that presents the turn as its own object (the Responses
    API's request fields, ``api.server.responses``), stored and forked with the turn.
    """

    index: int
    start: int
    end: int
    num_output_tokens: int
    finish_reason: FinishReason | None
    created_at: int
    num_chat_messages: int = 0
    chat_open: bool = False
    tool_calls: tuple[ParsedToolCall, ...] = ()
    num_cached_tokens: int = 0
    view: str | None = None


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """A turn as callers see it; ``token_ids`` only when asked for (fields as ``Turn``'s)."""

    index: int
    start: int
    end: int
    num_output_tokens: int
    finish_reason: FinishReason | None
    created_at: int
    token_ids: tuple[int, ...] | None = None
    tool_calls: tuple[ParsedToolCall, ...] = ()
    num_cached_tokens: int = 0
    view: str | None = None


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    """A session as callers see it (committed turns only; ``generating``: an append runs)."""

    session_id: str
    created_at: int
    metadata: dict[str, str]
    status: SessionStatus
    num_tokens: int
    num_turns: int
    parent_id: str | None
    fork_turn: int | None
    ttl: float
    generating: bool = False


@dataclass(eq=False)
class SpilledSegment:
    """One spilled head state and the sessions that resume from it (a parent and its forks).

    ``lock`` serialises loading it into the engine and moving it between tiers, so the forks
    of one parent import it once. Defined here, beside the ``Session`` that holds it, so the
    record does not depend on ``sessions.tiers`` (which owns and moves these segments).

    Args:
        segment_id: Unique id (the host pool's key and the disk file's name).
        owner_id: The session whose disk directory holds the file.
        num_tokens: The segment covers tokens ``[0, num_tokens)`` of every holder.
        nbytes: Payload bytes.
        tier: Where it lives now.
    """

    segment_id: str
    owner_id: str
    num_tokens: int
    nbytes: int
    tier: SpillTier
    holders: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(eq=False)
class Session:
    """A session's state, owned and mutated by ``SessionManager`` only.

    Runtime-only fields (``pin``, ``busy``, ``generation``, ``lock``, timers, ``segment``) are
    not persisted. ``lock`` serialises the short critical sections that change persisted state,
    the pin or the tier (commit, patch, delete, TTL expiry, spill); it is never held while a
    generation runs. ``segment`` is the spilled state this session resumes from (shared with
    forks); ``touched_at`` is the ``time.monotonic()`` of its last pin or unpin (LRU order);
    ``resumed`` is ``(tier, num_tokens)`` of the last resume, until the next turn counts it
    (``sessions._served``); ``carried`` is ``(tier, segment bytes, read seconds)`` of a spilled
    state the running append's request carries, a resume only if the engine loads it
    (``Spiller.count_carried``).
    """

    session_id: str
    owner: str
    created_at: int
    metadata: dict[str, str]
    ttl: float
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    chat_messages: list[Message] = field(default_factory=list)
    tools: tuple[ToolSpec, ...] | None = None
    parent_id: str | None = None
    fork_turn: int | None = None
    status: SessionStatus = "idle"
    pin: object | None = None
    pin_epoch: int = 0
    ttl_timer: asyncio.TimerHandle | None = None
    busy: bool = False
    generation: RunningGeneration | None = None
    deleted: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    segment: SpilledSegment | None = None
    touched_at: float = field(default_factory=time.monotonic)
    spill_retry_at: float = 0.0
    resumed: tuple[SpillTier, int] | None = None
    carried: tuple[SpillTier, int, float] | None = None

    @property
    def chat(self) -> ChatContext:
        """The chat context at the end of the last committed turn."""
        return self.chat_at(len(self.turns) - 1)

    def chat_at(self, turn_index: int) -> ChatContext:
        """The chat context at the end of turn ``turn_index`` (-1: before any turn)."""
        if turn_index < 0:
            return ChatContext((), self.tools, False)
        turn = self.turns[turn_index]
        return ChatContext(tuple(self.chat_messages[: turn.num_chat_messages]), self.tools,
                           turn.chat_open)

    def snapshot(self) -> SessionSnapshot:
        """The frozen view of this session."""
        return SessionSnapshot(
            session_id=self.session_id, created_at=self.created_at, metadata=dict(self.metadata),
            status=self.status, num_tokens=len(self.token_ids), num_turns=len(self.turns),
            parent_id=self.parent_id, fork_turn=self.fork_turn, ttl=self.ttl, generating=self.busy)

    def turn_info(self, turn: Turn, include_tokens: bool) -> TurnInfo:
        """The frozen view of one of this session's turns."""
        tokens = tuple(self.token_ids[turn.start:turn.end]) if include_tokens else None
        return TurnInfo(turn.index, turn.start, turn.end, turn.num_output_tokens,
                        turn.finish_reason, turn.created_at, tokens, turn.tool_calls,
                        turn.num_cached_tokens, turn.view)
