"""What the sessions layer reports: one log line per session transition, and the counters behind
``SessionManager.stats()`` (exported by ``api`` as Prometheus metrics).

Events (``runtime.logs.log_event``, logger ``phloem.sessions.events``)::

    session.created      session_id owner num_tokens
    session.forked       session_id (the parent) owner children at_turn
    session.deleted      session_id owner
    session.spilled      session_id tier num_tokens segment_bytes   (left the GPU's pins)
    session.resumed      session_id tier num_tokens segment_bytes duration_ms   (state loaded back)
    generation.finished  session_id (None: stateless) turn finish_reason prompt_tokens
                         cached_tokens completion_tokens duration_ms prepare_ms first_token_ms

Decisions on what counts (docs/api.md, "Observability"):

- tokens: a generation that ran in the engine (``finish_reason`` set, cancelled ones included)
  adds its ``usage`` — the API's own numbers — to ``prompt_tokens`` / ``cached_tokens`` /
  ``completion_tokens``. An append without generation computes nothing and adds nothing; a
  failed generation returns no usage and adds nothing.
- spills: a session that leaves the GPU's pins for ``host`` or ``disk`` counts once per move;
  bytes count segments written to a tier (a new segment, or a host segment demoted to disk), so
  forks sharing one segment do not multiply them.
- disk writes: every segment file written (a demotion, a spill straight to disk), with the
  seconds it waited for a segment worker, spent writing, and waited for the event loop after;
  host segments dropped because the disk fell a whole backlog behind (``sessions.tiers._segments``).
- resumes: a segment imported back into the engine counts once, with its bytes, tokens and
  seconds, by the tier it was read from; a resume that fails and falls back to recompute counts
  in ``resume_failures``.
- first token: each finished generation's seconds from its start (the input resolved) to its
  first token, and of those the ``prepare`` part (reading a spilled state back before the
  request is sent); the rest is the engine's queue and the prefill. By kind: ``session`` (an
  append) or ``stateless`` (a completion). A generation with no token is not observed.
- served tokens: each generated session turn attributes the session's tokens up to its last
  generated turn to ``gpu``, ``host``, ``disk`` or ``recomputed`` (``sessions._served``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from phloem.runtime.histogram import Histogram, HistogramSnapshot
from phloem.runtime.logs import log_event
from phloem.sessions._served import ServedCounter, ServedStats

if TYPE_CHECKING:
    from phloem.sessions.session import Session

__all__ = ["DiskWrites", "SessionEvents", "SessionStats", "TierCounts"]

logger = logging.getLogger("phloem.sessions.events")


class TokenCounts(Protocol):
    """The token counts of a finished generation (``sessions.generation.Usage`` has them); a
    protocol, so the events stay below ``generation`` (no import cycle)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class TierCounts:
    """Moves to or from one storage tier, and their payload bytes."""

    count: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class DiskWrites:
    """Segment files written, their payload bytes, and where their seconds went: waiting for a
    segment worker (``queued_s``), in the write and its fsyncs (``writing_s``), waiting for the
    event loop to take the result back (``resumed_s``); sums over the writes."""

    count: int = 0
    nbytes: int = 0
    queued_s: float = 0.0
    writing_s: float = 0.0
    resumed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SessionStats:
    """A snapshot of the sessions layer: plain numbers, for metrics.

    Args:
        sessions_by_status: Live sessions per status (every status present, zeros included).
        num_generations_in_flight: Generations started and not yet settled.
        generations: Finished generations by finish reason (``stop``, ``length``, ``cancelled``).
        prompt_tokens / cached_tokens / completion_tokens: Sums of the finished generations'
            usage (see the module docstring for what counts).
        sessions_created / sessions_forked / sessions_deleted: Lifecycle counts (``forked``
            counts children).
        spills: Sessions moved off the GPU, and bytes written, per tier (``host``, ``disk``).
        resumes: Segments imported back, and bytes read, per tier.
        resume_failures: Resumes that fell back to recomputing the history.
        host_pool_bytes / host_pool_budget_bytes: Spilled state held in host memory, and the cap.
        host_backlog_bytes: Spilled state in host memory waiting for room in the host pool.
        host_arena_bytes / host_arena_fallbacks: Host memory pinned once for the tier's copies
            (``storage.pinned_arena``), and the copies that found no range in it (pageable instead).
        disk_bytes: Payload bytes of the spilled segments on disk that sessions resume from.
        disk_writes: Segment files written, and their seconds by part.
        segments_dropped: Host segments dropped (not written) with the disk a backlog behind,
            and their payload bytes.
        served: Already-sent tokens of session turns by source, resume tokens and seconds by
            tier (``sessions._served``).
        first_token_seconds / prepare_seconds: Per generation kind (``session``,
            ``stateless``), seconds from a generation's start to its first token, and of those
            reading its spilled state back (module docstring).
    """

    sessions_by_status: dict[str, int]
    num_generations_in_flight: int
    generations: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    sessions_created: int
    sessions_forked: int
    sessions_deleted: int
    spills: dict[str, TierCounts]
    resumes: dict[str, TierCounts]
    resume_failures: int
    host_pool_bytes: int
    host_pool_budget_bytes: int
    host_backlog_bytes: int
    host_arena_bytes: int
    host_arena_fallbacks: int
    disk_bytes: int
    disk_writes: DiskWrites
    segments_dropped: TierCounts
    served: ServedStats
    first_token_seconds: dict[str, HistogramSnapshot]
    prepare_seconds: dict[str, HistogramSnapshot]


FIRST_TOKEN_SECONDS_BOUNDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
"""Upper bounds (seconds) of the first-token histograms: a cached agent turn (~0.1 s) up to a
long first turn queued behind others (a minute); finer around the 0.5 / 1.0 s TTFT targets."""
GENERATION_KINDS = ("session", "stateless")


class SessionEvents:
    """Logs each transition and keeps the counters (event loop only: no locking)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._generations: Counter[str] = Counter()
        # tier -> [moves, bytes]
        self._spills = {"host": [0, 0], "disk": [0, 0]}
        self._resumes = {"host": [0, 0], "disk": [0, 0]}
        self._writes = DiskWrites()
        self._dropped = TierCounts()
        self.served = ServedCounter()
        self._first_token = {kind: Histogram(FIRST_TOKEN_SECONDS_BOUNDS) for kind in GENERATION_KINDS}
        self._prepare = {kind: Histogram(FIRST_TOKEN_SECONDS_BOUNDS) for kind in GENERATION_KINDS}

    def stats(self, sessions_by_status: dict[str, int], num_generations_in_flight: int,
              host_pool: tuple[int, int, int], disk_bytes: int, host_arena: tuple[int, int]) -> SessionStats:
        """The counters, with the manager's live numbers (``host_pool``: used, budget and
        backlog bytes; ``disk_bytes``: spilled segments on disk; ``host_arena``: pinned bytes
        and fallbacks)."""
        c = self._counts
        return SessionStats(
            sessions_by_status=sessions_by_status, num_generations_in_flight=num_generations_in_flight,
            generations=dict(self._generations), prompt_tokens=c["prompt_tokens"],
            cached_tokens=c["cached_tokens"], completion_tokens=c["completion_tokens"],
            sessions_created=c["created"], sessions_forked=c["forked"], sessions_deleted=c["deleted"],
            spills={tier: TierCounts(*v) for tier, v in self._spills.items()},
            resumes={tier: TierCounts(*v) for tier, v in self._resumes.items()},
            resume_failures=c["resume_failures"], host_pool_bytes=host_pool[0],
            host_pool_budget_bytes=host_pool[1], host_backlog_bytes=host_pool[2],
            host_arena_bytes=host_arena[0], host_arena_fallbacks=host_arena[1], disk_bytes=disk_bytes,
            disk_writes=self._writes, segments_dropped=self._dropped, served=self.served.stats(),
            first_token_seconds={kind: h.snapshot() for kind, h in self._first_token.items()},
            prepare_seconds={kind: h.snapshot() for kind, h in self._prepare.items()})

    def created(self, session: Session) -> None:
        self._counts["created"] += 1
        log_event(logger, "session.created", session_id=session.session_id, owner=session.owner,
                  num_tokens=len(session.token_ids))

    def forked(self, parent: Session, children: list[Session], at_turn: int | None) -> None:
        self._counts["forked"] += len(children)
        log_event(logger, "session.forked", session_id=parent.session_id, owner=parent.owner,
                  children=[c.session_id for c in children], at_turn=at_turn)

    def deleted(self, session: Session) -> None:
        self._counts["deleted"] += 1
        log_event(logger, "session.deleted", session_id=session.session_id, owner=session.owner)

    def segment_written(self, tier: str, nbytes: int) -> None:
        """A segment was written to ``tier`` (placed there, or demoted from host to disk)."""
        self._spills[tier][1] += nbytes

    def segment_write(self, nbytes: int, queued_s: float, writing_s: float, resumed_s: float) -> None:
        """A segment file of ``nbytes`` was written (see ``DiskWrites`` for the seconds)."""
        w = self._writes
        self._writes = DiskWrites(w.count + 1, w.nbytes + nbytes, w.queued_s + queued_s,
                                  w.writing_s + writing_s, w.resumed_s + resumed_s)

    def segment_dropped(self, nbytes: int) -> None:
        """A host segment was dropped, not written: the disk was a whole backlog behind."""
        self._dropped = TierCounts(self._dropped.count + 1, self._dropped.nbytes + nbytes)

    def spilled(self, session: Session, tier: str) -> None:
        """The session left the GPU's pins for ``tier``."""
        self._spills[tier][0] += 1
        segment = session.segment
        log_event(logger, "session.spilled", session_id=session.session_id, tier=tier,
                  num_tokens=segment.num_tokens if segment else 0,
                  segment_bytes=segment.nbytes if segment else 0)

    def resumed(self, session: Session, tier: str, num_tokens: int, nbytes: int,
                seconds: float) -> None:
        """A segment of ``session`` was read back from ``tier`` in ``seconds`` and imported on
        prefetch (``seconds`` then include the import), or handed to its next request and loaded
        by the engine as it admitted it (counted when that turn ends: a copy the engine did not
        need, the prefix still cached, is no resume)."""
        self._resumes[tier][0] += 1
        self._resumes[tier][1] += nbytes
        self.served.resumed(tier, num_tokens, seconds)
        log_event(logger, "session.resumed", session_id=session.session_id, tier=tier,
                  num_tokens=num_tokens, segment_bytes=nbytes, duration_ms=round(1000 * seconds, 2))

    def resume_failed(self) -> None:
        self._counts["resume_failures"] += 1

    def generation_finished(self, session_id: str | None, turn: int | None, finish_reason: str,
                            usage: TokenCounts, duration_s: float, prepare_s: float,
                            first_token_s: float | None) -> None:
        self._generations[finish_reason] += 1
        if first_token_s is not None:
            kind = "stateless" if session_id is None else "session"
            self._first_token[kind].observe(first_token_s)
            self._prepare[kind].observe(prepare_s)
        self._counts["prompt_tokens"] += usage.prompt_tokens
        self._counts["cached_tokens"] += usage.cached_tokens
        self._counts["completion_tokens"] += usage.completion_tokens
        log_event(logger, "generation.finished", session_id=session_id, turn=turn,
                  finish_reason=finish_reason, prompt_tokens=usage.prompt_tokens,
                  cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                  duration_ms=round(1000 * duration_s, 2), prepare_ms=round(1000 * prepare_s, 2),
                  first_token_ms=None if first_token_s is None else round(1000 * first_token_s, 2))

