"""A fixed-bucket histogram kept on the engine thread, and the frozen snapshot it hands out.

The engine loop times every step into a ``Histogram`` (no lock: only its thread writes it, and
``snapshot`` runs on that thread too, answering ``GetStats``). Upper layers read the
``HistogramSnapshot`` — plain numbers — and export them (``api`` as a Prometheus histogram).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STEP_KINDS", "STEP_SECONDS_BOUNDS", "Histogram", "HistogramSnapshot"]

STEP_SECONDS_BOUNDS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the engine-step histogram: a CUDA-graph decode step (~ms) up to a
long chunked prefill on CPU (seconds); finer where GPU decode steps (7.5–25 ms) and a tool
result's mixed step (50–250 ms) fall, so their distributions can be told from a first turn's
8K-token chunks."""
STEP_KINDS = ("decode", "mixed", "prefill")
"""Kinds of engine step timed apart: one token per request, prompts only, or both in one step."""


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Observations so far.

    Args:
        bounds: Upper bounds of the finite buckets, ascending (a value equal to a bound counts
            in that bucket, as in Prometheus).
        counts: Observations per bucket, not cumulative: ``len(bounds) + 1`` entries, the last
            one for values above every bound.
        total: The sum of every observed value.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        """The number of observations."""
        return sum(self.counts)


class Histogram:
    """Counts values into buckets with fixed upper ``bounds``.

    Args:
        bounds: Finite upper bounds, strictly ascending.

    Raises:
        ValueError: ``bounds`` is empty or not strictly ascending.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        if not bounds or any(b >= c for b, c in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds: expected strictly ascending upper bounds, got {tuple(bounds)}")
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        """Count one value."""
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        """The counts so far (a copy)."""
        return HistogramSnapshot(self._bounds, tuple(self._counts), self._total)
