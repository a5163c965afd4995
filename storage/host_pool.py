"""Host tier: spilled segments kept in (pinned) host memory under a byte budget.

Accounting is exact and simple: a segment costs `Segment.nbytes` (the tensors' payload), counted
when `HostPool.put` accepts it and released when it leaves. The pool never evicts by itself:
`put` raises `StorageFull` and the caller (the sessions layer, which knows pins and TTLs) decides
what to demote to disk, using `oldest` for least-recently-used order.

Decisions: an ``OrderedDict`` keyed by segment id is the LRU list (``move_to_end`` on `get`, front
is the oldest), so every operation is O(1). Segment ids are unique across sessions (random ids),
so the pool does not key by session. With ``pin_memory`` the pool copies each tensor into
page-locked memory once, on `put`, so the later host-to-device copy on resume can be async;
without it the pool keeps the caller's CPU tensors as they are (it takes ownership, no copy).
A lock makes the pool safe to share between the engine thread and the API event loop.

With ``arena_bytes`` (and pinning) the pool pins that much host memory once, when it is built
(``storage.pinned_arena``: pinning costs ~20x the copy it enables and stalls other threads'
CUDA calls meanwhile), and every pinned copy of the tier comes from it where a range fits:
`put`'s, a disk read's (``alloc``), and the engine's spill copies (``alloc`` handed to the export).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .errors import StorageFull
from .pinned_arena import HostAlloc, PinnedArena
from .segment import Segment

__all__ = ["HostPool"]


class HostPool:
    """Segments in host memory, in least-recently-used order, under a byte budget.

    Args:
        byte_budget: Most payload bytes held at once.
        pin_memory: Copy tensors into pinned memory on `put`; ``None`` means "when CUDA exists".
        arena_bytes: Host memory to pin now for the tier's pinned copies (the module docstring);
            0, or no pinning: none.

    Raises:
        ValueError: ``byte_budget`` or ``arena_bytes`` is negative, or pinning is asked for
            without CUDA.
    """

    def __init__(self, byte_budget: int, pin_memory: bool | None = None, arena_bytes: int = 0) -> None:
        for name, value in (("byte_budget", byte_budget), ("arena_bytes", arena_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise ValueError("pin_memory=True needs CUDA, and torch.cuda.is_available() is False")
        self.byte_budget = byte_budget
        self.pin_memory = cuda if pin_memory is None else pin_memory
        self.arena = PinnedArena(arena_bytes) if self.pin_memory and arena_bytes else None
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Payload bytes of the segments held now."""
        return self._used_bytes

    @property
    def alloc(self) -> HostAlloc | None:
        """The arena's allocator (a pinned tensor, None where no range fits); None without an arena."""
        return self.arena.alloc if self.arena is not None else None

    @property
    def free_bytes(self) -> int:
        """Bytes left under the budget."""
        return self.byte_budget - self._used_bytes

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._segments

    def can_store(self, nbytes: int) -> bool:
        """Whether a segment of ``nbytes`` payload bytes fits under the budget now."""
        return nbytes <= self.free_bytes

    def put(self, segment: Segment) -> None:
        """Hold ``segment`` as the most recently used one.

        Args:
            segment: A segment whose id is not in the pool yet.

        Raises:
            StorageFull: the segment does not fit; the pool is unchanged.
            ValueError: a segment with the same id is already held.
        """
        segment_id = segment.meta.segment_id
        nbytes = segment.nbytes
        with self._lock:
            if segment_id in self._segments:
                raise ValueError(f"segment {segment_id!r} is already in the pool; pop it first")
            if nbytes > self.free_bytes:
                raise StorageFull(
                    f"host pool needs {nbytes} bytes for segment {segment_id!r}, "
                    f"has {self.free_bytes} free of {self.byte_budget}"
                )
            self._segments[segment_id] = self._to_host(segment)
            self._used_bytes += nbytes

    def get(self, segment_id: str) -> Segment | None:
        """Return the segment and mark it most recently used; ``None`` if absent."""
        with self._lock:
            segment = self._segments.get(segment_id)
            if segment is not None:
                self._segments.move_to_end(segment_id)
            return segment

    def pop(self, segment_id: str) -> Segment | None:
        """Remove and return the segment (to promote or demote it); ``None`` if absent."""
        with self._lock:
            segment = self._segments.pop(segment_id, None)
            if segment is not None:
                self._used_bytes -= segment.nbytes
                assert self._used_bytes >= 0, f"accounting went negative: {self._used_bytes}"
            return segment

    def remove(self, segment_id: str) -> bool:
        """Drop the segment; return whether it was held."""
        return self.pop(segment_id) is not None

    def oldest(self) -> Segment | None:
        """The least recently used segment (the first to demote), without touching its order."""
        with self._lock:
            return next(iter(self._segments.values()), None)

    def segment_ids(self) -> list[str]:
        """Ids held now, least recently used first."""
        with self._lock:
            return list(self._segments)

    def _to_host(self, segment: Segment) -> Segment:
        return segment.on_host(pinned=self.pin_memory, alloc=self.alloc)
