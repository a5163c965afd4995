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

import torch

from phloem.engine import CacheStats, EngineError, MemoryWait, RequestOutput, SamplingParams, SpeculationStats
from phloem.engine.transfer import HostAlloc, PrefixState, TransferReservation
from phloem.runtime.histogram import HistogramSnapshot

__all__ = [
    "AbortRequest",
    "AddRequest",
    "Command",
    "EngineStats",
    "ExportPrefix",
    "GetStats",
    "HostAlloc",
    "ImportPrefix",
    "InstallTransfer",
    "OutputSink",
    "PinPrefix",
    "PrefixHandle",
    "PrefixState",
    "QueryCachedPrefix",
    "QueryWaitsForMemory",
    "AttachResume",
    "ReleaseTransfer",
    "ReserveTransfer",
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
    """Enqueue a request; ``reply`` gets its id, or the ``InvalidRequest``/``CapacityExceeded``.

    ``output_token_ids``: tokens already generated elsewhere (a disaggregated prefill's first
    token); the request continues after them. ``namespace``: its prefix-cache namespace (tenant);
    None: the shared one. ``prefill_only``: compute the prompt, publish its checkpoint, sample
    nothing; ``hold_turn_end``: keep its turn-end checkpoint locked until pinned;
    ``resume``: a spilled prefix of the prompt, loaded as the request is admitted
    (``Engine.add_request``).
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    request_id: str | None
    sink: OutputSink
    output_token_ids: tuple[int, ...] = ()
    namespace: str | None = None
    prefill_only: bool = False
    hold_turn_end: bool = False
    resume: PrefixState | None = None
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
    namespace: str | None = None
    reply: Future[PrefixHandle | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class UnpinPrefix:
    handle: PrefixHandle
    reply: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class QueryCachedPrefix:
    token_ids: tuple[int, ...]
    namespace: str | None = None
    # Answered only once no request is finalizing (its turn-end checkpoint counted); False:
    # at once, between the current steps (a caller that does not ask about a just-ended turn).
    settled: bool = True
    reply: Future[int] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class AttachResume:
    """Give a waiting request a spilled prefix to load at admission (``Engine.attach_resume``);
    ``reply`` is False when it runs already."""

    request_id: str
    state: PrefixState
    reply: Future[bool] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class QueryWaitsForMemory:
    """Whether a request waits because the engine has no memory for it (``Engine.waits_for_memory``)."""

    request_id: str
    reply: Future[MemoryWait] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ExportPrefix:
    """Host copies of the deepest cached checkpoint within ``token_ids`` (``None``: nothing
    cached), in ``host_alloc``'s memory where it serves them."""

    token_ids: tuple[int, ...]
    namespace: str | None = None
    host_alloc: HostAlloc | None = None
    reply: Future[PrefixState | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ImportPrefix:
    """Load a spilled prefix into the radix cache; ``reply`` is False when no room could be made."""

    state: PrefixState
    namespace: str | None = None
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


@dataclass(frozen=True, slots=True)
class ReserveTransfer:
    """Decode side of a disaggregated prefill: lock the cached prefix of ``token_ids`` and reserve
    pages and a slot for the rest; ``reply`` is None (nothing taken) when a prefix is cached and at
    most ``local_up_to`` tokens lie past it, or no room can be made, or the ``InvalidRequest`` /
    ``CapacityExceeded`` of a prompt the engine could never serve (``Engine.reserve_transfer``)."""

    token_ids: tuple[int, ...]
    params: SamplingParams
    local_up_to: int = 0
    namespace: str | None = None
    reply: Future[TransferReservation | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class InstallTransfer:
    """Install a received prompt state into its reservation and publish it (``Engine.install_transfer``)."""

    reservation: TransferReservation
    kv: torch.Tensor  # [attn_layers, reserved pages, 2, page_size, kv_heads, head_dim]
    conv: torch.Tensor  # [gdn_layers, conv_dim, kernel - 1]
    ssm: torch.Tensor  # [gdn_layers, v_heads, key_dim, value_dim] fp32
    reply: Future[None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class ReleaseTransfer:
    """Give back a reservation's pages and slot and unlock its prefix (idempotent)."""

    reservation: TransferReservation
    reply: Future[None] = field(default_factory=Future)


Command: TypeAlias = (
    AddRequest | AbortRequest | PinPrefix | UnpinPrefix | QueryCachedPrefix | ExportPrefix | ImportPrefix
    | ResetPrefixCache | GetStats | Shutdown | ReserveTransfer | InstallTransfer | ReleaseTransfer
    | QueryWaitsForMemory
    | AttachResume
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
    num_waiting: int  # queued in the scheduler, not yet admitted (queue depth)
    num_running: int  # admitted: holding pages and a state slot
    step_seconds: HistogramSnapshot  # wall time of each engine step, failed ones included
    memory_blocked: bool = False  # the waiting requests wait for memory, not for their turn
    # Wall time of each step by the kind it collected (``STEP_KINDS``), the loop's host time
    # between steps while requests were in flight, and the decode steps queued behind another.
    step_kind_seconds: dict[str, HistogramSnapshot] = field(default_factory=dict)
    between_steps_seconds: float = 0.0
    # Engine-thread seconds answering commands, by command class name (``ExportPrefix``...).
    command_seconds: dict[str, float] = field(default_factory=dict)
    num_pipelined_steps: int = 0
    # Of those, steps that admitted waiting requests beside the decode rows (mixed steps).
    num_pipelined_mixed_steps: int = 0
    # Running requests preempted for pages (``engine.scheduler``: they wait again and recompute
    # what the cache lost of them).
    num_preemptions: int = 0
    # Speculative decoding's counters (``Engine.speculation_stats``); None when it is off.
    speculation: SpeculationStats | None = None
