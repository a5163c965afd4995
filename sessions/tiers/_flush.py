"""The shutdown flush: on a graceful stop, write to disk the session state a restart would lose.

Host memory and the GPU die with the process; only the disk tier survives a restart
(docs/architecture.md, "Session state tiers": Durability), and a session without a disk segment resumes by recomputing its whole
history. So before the sessions layer closes (SIGINT/SIGTERM, after the open streams ended):

    1. every segment in the host pool is demoted to disk (its holders become ``disk``);
    2. then sessions whose state is only on the GPU (``active`` or ``idle``), most recently
       used first, are spilled to disk (an export from the engine, which still runs).

Bounded: nothing new starts once ``budget_s`` has passed (the move in progress finishes), and
what was not written resumes by recompute, as without a flush. Progress: one log line when it starts, one
when it ends (written, bytes, seconds, what was left), and a bar on a terminal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.runtime.progress import progress_bar
from phloem.sessions.session import Session, SpillTier

if TYPE_CHECKING:
    from phloem.sessions.tiers._segments import SegmentTiers

__all__ = ["FlushReport", "flush_to_disk"]

logger = logging.getLogger("phloem.sessions.shutdown")


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What the flush wrote: segments from host memory and sessions from the GPU, of how many."""

    num_from_host: int
    num_from_gpu: int
    num_total: int
    seconds: float

    @property
    def num_written(self) -> int:
        return self.num_from_host + self.num_from_gpu


async def flush_to_disk(spill: Callable[[Session, SpillTier], Awaitable[bool]],
                        tiers: SegmentTiers, sessions: Iterable[Session],
                        budget_s: float) -> FlushReport:
    """Write host segments, then GPU-only sessions, to disk within ``budget_s`` seconds.

    Args:
        spill: Spills a resident session to a tier (``Spiller.spill``, whose sweeper is
            stopped); a callback, so this module does not import ``spill`` (which imports it).
        tiers: The segment registry (host segments are demoted through it).
        sessions: The live sessions.
        budget_s: Seconds after which no new write starts.

    Returns:
        What was written.
    """
    t0 = time.monotonic()
    host = [e for e in tiers.entries() if e.tier == "host"]
    resident = sorted((s for s in sessions if _resident(s)), key=lambda s: s.touched_at, reverse=True)
    total = len(host) + len(resident)
    if not total:
        return FlushReport(0, 0, 0, 0.0)
    logger.info("shutdown: writing %d session state(s) to disk (%d from host memory, %d from the GPU), "
                "for at most %.0f s", total, len(host), len(resident), budget_s)
    done_host = done_gpu = 0
    with progress_bar(total, "writing sessions to disk", "segment") as advance:
        for entry in host:
            if time.monotonic() - t0 >= budget_s:
                break
            done_host += int(await tiers.demote(entry))
            advance(1)
        for session in resident:
            if time.monotonic() - t0 >= budget_s:
                break
            async with session.lock:
                if _resident(session) and await spill(session, "disk"):
                    done_gpu += 1
            advance(1)
    report = FlushReport(done_host, done_gpu, total, time.monotonic() - t0)
    _log(report, budget_s)
    return report


def _resident(session: Session) -> bool:
    """Its state lives only on the GPU (pinned or not), and nothing else is moving it."""
    return (session.status in ("active", "idle") and bool(session.token_ids) and not session.busy
            and not session.deleted)


def _log(report: FlushReport, budget_s: float) -> None:
    left = report.num_total - report.num_written
    if left and report.seconds >= budget_s:
        logger.warning("shutdown: stopped at the %.0f s limit: %d of %d written to disk; the other %d "
                       "resume by recompute after a restart", budget_s, report.num_written,
                       report.num_total, left)
    else:
        logger.info("shutdown: %d of %d session state(s) written to disk in %.2f s (%d from host "
                    "memory, %d from the GPU)", report.num_written, report.num_total, report.seconds,
                    report.num_from_host, report.num_from_gpu)
