"""Page-locked host memory for spilled session state: pinned once, handed out in ranges.

A spill copies a session's KV pages and GDN state from the GPU into host memory on the engine
thread, so every running request waits for it. A pinned destination makes the copy itself fast
(~50 GB/s on an H100 host, against ~6 GB/s into pageable memory) and lets the resume's copy back
run beside the steps, but pinning is the expensive part: ``cudaHostAlloc`` page-locks at
~2.7 GB/s, so a 250 MB segment (8.9K tokens at the 35B-A3B shape) spends ~94 ms pinning and ~5 ms
copying. torch's caching host allocator reuses freed blocks, but a host tier that is filling keeps
every block it was given, so until the tier first fills each spill pins anew, and each block is
rounded up to a power of two (a 260 MB segment pins 512 MB).

The arena pins its capacity once, in chunks, when it is built, and serves each allocation as a
range of a chunk: first fit in offset order, a freed range merged with its free neighbours. It is
built before the engine thread starts (the server's start-up): pinning takes a lock that CUDA
calls on other threads wait for, so an arena pinning beside running steps would stall them as a
spill's own pinning does (a 1 GiB chunk held a thread's 0.2-ms steps for ~1.1 s on an H100 host).
An allocation is a tensor over its range, built on a numpy array of the range that the tensor's
storage keeps alive, with a finalizer on that array: the range goes back to the arena only when
no tensor, view or numpy array over it is left, whichever thread drops the last one (the
finalizer only queues the range; the next call under the arena's lock frees it). An asynchronous
reader must hold the tensor until its copy has ended (``engine.copy_fence.StreamFence`` keeps its
sources).

``alloc`` returns None when no free range fits (``fallbacks`` counts those): the callers then copy
into pageable memory, never pinning beside the steps (``Segment.on_host``,
``engine.transfer.prefix_export``). Chunks cap a range's size, and first fit leaves up to a
segment's bytes unused at each chunk's end: 4 GiB chunks hold a 200K-token session's KV at the
35B-A3B shape (20 KB a token) and leave a few percent of the arena between 250-350 MB segments
(1 GiB chunks left up to a fifth of each, and could not hold the KV of a session past 52K tokens,
the record's workload by its second turn). Pinning that fails part way (out of pinnable memory)
leaves the chunks pinned so far.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["HostAlloc", "PinnedArena"]

# ``(shape, dtype)`` -> an uninitialised pinned host tensor, or None where none fits (``PinnedArena.alloc``).
HostAlloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None]

logger = logging.getLogger(__name__)

_ALIGN = 512  # bytes: every range starts at a multiple (any dtype's alignment, and then some)


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


@dataclass(slots=True)
class _Chunk:
    """One pinned buffer and its free ranges ``(offset, size)``, sorted by offset, never adjacent."""

    buffer: torch.Tensor  # uint8, owns the pinned memory
    base: np.ndarray  # the same memory, for per-allocation numpy views
    free: list[tuple[int, int]] = field(default_factory=list)

    def take(self, size: int) -> int | None:
        """The offset of the first free range of at least ``size`` bytes, now taken; None if none."""
        for i, (offset, n) in enumerate(self.free):
            if n >= size:
                if n == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, n - size)
                return offset
        return None

    def give_back(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (offset, 0))
        if i < len(self.free):
            nxt_off, nxt_n = self.free[i]
            assert offset + size <= nxt_off, f"range {offset}+{size} freed twice or overlapping {nxt_off}"
            if offset + size == nxt_off:
                size += nxt_n
                del self.free[i]
        if i > 0:
            prev_off, prev_n = self.free[i - 1]
            assert prev_off + prev_n <= offset, f"range {offset}+{size} freed twice or overlapping {prev_off}"
            if prev_off + prev_n == offset:
                self.free[i - 1] = (prev_off, prev_n + size)
                return
        self.free.insert(i, (offset, size))


class PinnedArena:
    """Ranges of page-locked host memory, pinned once (see the module docstring).

    Args:
        capacity_bytes: Bytes to pin in all (the host tier's budget and its backlog's).
        chunk_bytes: Size of one pinned buffer, the largest allocation the arena serves.
        allocate: ``nbytes -> uint8 tensor``, the buffers' allocator (default: pinned host
            memory; a test passes a pageable one).

    Raises:
        ValueError: ``capacity_bytes`` or ``chunk_bytes`` is not a positive int.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int = 4 << 30,
                 allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an int > 0, got {value!r}")
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.used_bytes = 0  # bytes of ranges handed out and not yet back
        self.fallbacks = 0  # allocations not served (no chunk pinned yet, or no range fits)
        self._allocate = allocate or _pinned
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        self._released: deque[tuple[_Chunk, int, int]] = deque()  # ranges whose tensors are gone
        sizes = [chunk_bytes] * (capacity_bytes // chunk_bytes)
        if capacity_bytes % chunk_bytes:
            sizes.append(capacity_bytes % chunk_bytes)
        self._pin(sizes)

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned (``capacity_bytes`` unless pinning failed part way)."""
        with self._lock:
            return sum(c.buffer.numel() for c in self._chunks)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised ``shape``/``dtype`` tensor in pinned memory, or None (allocate elsewhere)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        with self._lock:
            self._collect()
            for chunk in self._chunks:
                offset = chunk.take(size)
                if offset is not None:
                    break
            else:
                self.fallbacks += 1
                return None
            self.used_bytes += size
        view = chunk.base[offset: offset + size]  # one numpy object per allocation: its lifetime is the range's
        weakref.finalize(view, self._released.append, (chunk, offset, size))
        return torch.from_numpy(view)[:nbytes].view(dtype).view(shape)

    def collect(self) -> None:
        """Return the ranges whose tensors are gone (``alloc`` does it too); for stats and tests."""
        with self._lock:
            self._collect()

    def _collect(self) -> None:
        while self._released:
            chunk, offset, size = self._released.popleft()
            chunk.give_back(offset, size)
            self.used_bytes -= size

    def _pin(self, sizes: list[int]) -> None:
        try:
            for n in sizes:
                buffer = self._allocate(n)
                chunk = _Chunk(buffer, buffer.numpy(), [(0, n)])
                with self._lock:
                    self._chunks.append(chunk)
        except (RuntimeError, MemoryError) as exc:  # out of host memory or of pinnable memory
            logger.warning("pinned arena: pinned %d of %d bytes, then: %s; copies past it go to pageable memory",
                           sum(c.buffer.numel() for c in self._chunks), self.capacity_bytes, exc)
