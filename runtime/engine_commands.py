"""Typed commands of the engine loop, and the stats snapshot it answers ``GetStats`` with.

Each command is a frozen dataclass dispatched on its type (never a method name) and carries a
``concurrent.futures.Future`` for its reply. A caller may cancel that future before the engine
thread picks the command up; the command is then skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeAlias

from phloem.engine import EngineError, RequestOutput, SamplingParams
from phloem.engine.cache_manager import CacheStats
from phloem.engine.prefix_state import PrefixState

__all__ = [
    "AbortRequest",
    "AddRequest",
    "Command",
    "EngineStats",
    "ExportPrefix",
    "GetStats",
    "ImportPrefix",
    "OutputSink",
    "PinPrefix",
    "PrefixHandle",
    "PrefixState",
    "QueryCachedPrefix",
    "ResetPrefixCache",
    "Shutdown",
    "UnpinPrefix",
]

OutputSink: TypeAlias = Callable[[RequestOutput | EngineError], None]
"""Receives each output of one request, or the single error that ended it (engine thread)."""

PrefixHandle: TypeAlias = object
"""Opaque handle of a pinned prefix; only ``UnpinPrefix`` looks inside."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Enqueue a request; ``reply`` gets its id, or the ``InvalidRequest``/``CapacityExceeded``."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str | None
    sink: OutputSink
    reply: Future[str] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Abort a request; ``reply`` says whether it was in flight.

    With ``sink`` set, only a request added with that very sink is aborted: a consumer cleaning
    up after itself must never abort another request that reuses the id.
    """

    request_id: str
    sink: OutputSink | None = None
    reply: Future[bool] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class PinPrefix:
    token_ids: tuple[int, ...]
    reply: Future[PrefixHandle | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class UnpinPrefix:
    handle: PrefixHandle
    reply: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class QueryCachedPrefix:
    token_ids: tuple[int, ...]
    reply: Future[int] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ExportPrefix:
    """Host copies of the deepest cached checkpoint within ``token_ids`` (``None``: nothing cached)."""

    token_ids: tuple[int, ...]
    reply: Future[PrefixState | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ImportPrefix:
    """Load a spilled prefix into the radix cache; ``reply`` is False when no room could be made."""

    state: PrefixState
    reply: Future[bool] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Drop every unpinned prefix from the radix cache (pinned heads and running requests stay)."""

    reply: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class GetStats:
    reply: Future[EngineStats] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort everything in flight (sinks get an ``EngineError``), let pending turn-end checkpoints
    land, and stop the thread."""

    reply: Future[None] = field(default_factory=Future)


Command: TypeAlias = (
    AddRequest | AbortRequest | PinPrefix | UnpinPrefix | QueryCachedPrefix | ExportPrefix | ImportPrefix
    | ResetPrefixCache | GetStats | Shutdown
)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A consistent snapshot, taken on the engine thread between two steps."""

    cache: CacheStats
    num_pages: int
    num_free_pages: int
    num_slots: int
    num_free_slots: int
    num_requests: int  # in flight through this loop (finished ones excluded)
    num_steps: int
    num_failed_steps: int
