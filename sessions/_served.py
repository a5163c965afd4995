"""Where each turn's already-sent tokens came from: the GPU's prefix cache, a spill tier, or
recompute; and what each tier's resumes cost (``SessionStats.served``, exported by ``api``).

A session turn's prompt is ``history + new``; ``history`` (the session's tokens up to the end
of its last generated turn: sent by the client or written by the model, and computed before)
is the only part a cache can serve; tokens appended without generation count as new. The
engine reports ``cached`` (prompt tokens its prefix cache held once the request was admitted);
of the history, ``min(cached, history)`` was served, the rest recomputed::

    history: [ from a tier (resumed) | from the GPU cache | recomputed ]
               <- min(resumed, hit) -> <-- hit - tier --->  <- history - hit ->
               hit = min(cached, history)

``resumed`` is the prefix the session's last resume imported (``Session.resumed``: by the
append itself or by an earlier prefetch) and is counted once, by the first turn after it: a
tier served those tokens and the GPU cache served the rest of the hit. Stateless requests have
no session and are not counted here (their hits are ``cached_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from phloem.runtime.histogram import Histogram, HistogramSnapshot

__all__ = ["RESUME_SECONDS_BOUNDS", "SERVED_SOURCES", "ServedCounter", "ServedStats"]

SERVED_SOURCES = ("gpu", "host", "disk", "recomputed")
RESUME_TIERS = ("host", "disk")
RESUME_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of a resume (load + import): a small host segment on a GPU (~ms) up
to a multi-GB segment read from disk (seconds)."""


@dataclass(frozen=True, slots=True)
class ServedStats:
    """Served-token and resume counters, plain numbers.

    Args:
        served_tokens: Already-sent tokens of session turns by source (``SERVED_SOURCES``).
        resume_tokens: Tokens imported by resumes, by the tier read (``host``, ``disk``).
        resume_seconds: Wall time of each resume (segment load + engine import), by tier.
    """

    served_tokens: dict[str, int]
    resume_tokens: dict[str, int]
    resume_seconds: dict[str, HistogramSnapshot]


class ServedCounter:
    """Counts served tokens per turn and resumes per tier (event loop only: no locking)."""

    def __init__(self) -> None:
        self._served = dict.fromkeys(SERVED_SOURCES, 0)
        self._resume_tokens = dict.fromkeys(RESUME_TIERS, 0)
        self._resume_seconds = {tier: Histogram(RESUME_SECONDS_BOUNDS) for tier in RESUME_TIERS}

    def stats(self) -> ServedStats:
        return ServedStats(dict(self._served), dict(self._resume_tokens),
                           {tier: h.snapshot() for tier, h in self._resume_seconds.items()})

    def resumed(self, tier: str, num_tokens: int, seconds: float) -> None:
        """A resume imported ``num_tokens`` read from ``tier`` in ``seconds``."""
        self._resume_tokens[tier] += num_tokens
        self._resume_seconds[tier].observe(seconds)

    def turn(self, history_len: int, cached_tokens: int, resumed: tuple[str, int] | None) -> None:
        """Attribute a turn's ``history_len`` already-sent tokens (module docstring).

        Args:
            history_len: Tokens the session held before the append.
            cached_tokens: Prompt tokens the engine's prefix cache served.
            resumed: ``(tier, num_tokens)`` of the resume since the last turn, if any.
        """
        hit = min(cached_tokens, history_len)
        from_tier = min(resumed[1], hit) if resumed is not None else 0
        if resumed is not None:
            self._served[resumed[0]] += from_tier
        self._served["gpu"] += hit - from_tier
        self._served["recomputed"] += history_len - hit
