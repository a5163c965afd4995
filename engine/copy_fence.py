"""A copy queued on a side stream, and how the engine's stream waits for it.

Resuming a spilled session copies its KV pages and GDN state from pinned host memory into the
pools. On the engine's own stream that copy would sit between two steps (every running request
waits for it); the engine would also have to drain the async pipeline first. Instead the copy is
queued on a side stream (after everything already queued on the engine's stream, whose memory
it may reuse) and returns a ``StreamFence``: the engine's stream waits on its event only before
the first work that reads what the copy writes (``engine.cache.import_fences``), so the copy runs
beside the steps of the requests that do not need it.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CopyFence", "StreamFence"]


class CopyFence(Protocol):
    """A queued copy: ``done`` without blocking, ``wait`` orders the engine's stream after it."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class StreamFence:
    """The end of a copy queued on a side stream (a recorded CUDA event), holding the copy's
    host sources until then: memory not from torch's caching host allocator (a
    ``storage.PinnedArena`` range) is reused as soon as its last tensor goes, and torch records
    no event for it. Whoever tracks the fence (``engine.cache.import_fences``) keeps it until
    ``done``."""

    __slots__ = ("_device", "_event", "_sources")

    def __init__(self, stream: torch.cuda.Stream, sources: tuple[torch.Tensor, ...] = ()) -> None:
        self._device = stream.device
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._sources: tuple[torch.Tensor, ...] | None = sources

    def done(self) -> bool:
        if not self._event.query():
            return False
        self._sources = None
        return True

    def wait(self) -> None:
        """Make the current stream wait for the copy (on the device: the host does not block)."""
        torch.cuda.current_stream(self._device).wait_event(self._event)
