"""Rank simulation: one rank of an N-rank group in one process, its collectives local and counted.

``SimulatedCollectives`` stands in for the c10d backend of ``TPGroup`` (``TPGroup(0, N, device,
SimulatedCollectives(N))``): the model built with that group is rank 0's shard, exactly as the TP
loader builds it, and runs alone. Each collective becomes one local copy of the bytes this rank
would send, so a step's compute and memory traffic are the rank's own; the wire time is not
simulated (``benchmarks.simulated_tp`` adds a per-collective latency, labelled a projection).

Values: an all-reduce leaves this rank's partial sum in place (no other rank adds its part), a
gather fills every rank's slot with this rank's tensor, a broadcast or scatter leaves the output
as it is. The numbers are not a TP=N model's, the shapes and the traffic are.

``CollectiveTally`` counts calls and bytes by kind (``all_reduce``, ``gather``, ...): bytes are
those of the tensor this rank passes in, the same figure for a real backend
(``CountingCollectives`` wraps one, for tests that check the simulation against real ranks).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CollectiveTally", "CountingCollectives", "SimulatedCollectives"]


@dataclass(slots=True)
class CollectiveTally:
    """Collective calls and their bytes by kind, since construction or the last ``reset``."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def record(self, kind: str, tensors: list[torch.Tensor]) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """``{kind: (calls, bytes)}``, a copy."""
        return {kind: (n, self.bytes[kind]) for kind, n in sorted(self.calls.items())}


class _Done:
    """A finished work handle (``Work.wait``)."""

    def wait(self) -> bool:
        return True


class SimulatedCollectives:
    """A c10d-backend stand-in for rank 0 of ``size`` ranks: local copies, counted in ``tally``.

    Only the calls ``TPGroup`` makes (with a list of one tensor, as ``TPGroup`` passes them).
    """

    def __init__(self, size: int) -> None:
        assert size > 1, f"a simulated group has at least two ranks, got {size}"
        self.size = size
        self.tally = CollectiveTally()

    def allreduce(self, tensors: list[torch.Tensor], options: Any = None) -> _Done:
        self.tally.record("all_reduce", tensors)
        for t in tensors:
            # One read and one write of the buffer, where the all-reduce would move it; the
            # partial sum stays in place.
            torch.empty_like(t).copy_(t)
        return _Done()

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: Any) -> _Done:
        self.tally.record("gather", inputs)
        for parts, x in zip(outputs, inputs):
            for part in parts:
                part.copy_(x)
        return _Done()

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], options: Any) -> _Done:
        self.tally.record("scatter", outputs)
        return _Done()

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _Done:
        self.tally.record("broadcast", tensors)
        return _Done()


class CountingCollectives:
    """A real c10d backend whose calls are also counted in ``tally`` (the figures
    ``SimulatedCollectives`` reports, for the same calls)."""

    def __init__(self, inner: Any, tally: CollectiveTally) -> None:
        self.inner = inner
        self.tally = tally

    def allreduce(self, tensors: list[torch.Tensor], options: Any = None) -> Any:
        self.tally.record("all_reduce", tensors)
        return self.inner.allreduce(tensors) if options is None else self.inner.allreduce(tensors, options)

    def gather(self, outputs: Any, inputs: list[torch.Tensor], options: Any) -> Any:
        self.tally.record("gather", inputs)
        return self.inner.gather(outputs, inputs, options)

    def scatter(self, outputs: list[torch.Tensor], inputs: Any, options: Any) -> Any:
        self.tally.record("scatter", outputs)
        return self.inner.scatter(outputs, inputs, options)

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        self.tally.record("broadcast", tensors)
        return self.inner.broadcast(tensors, options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
