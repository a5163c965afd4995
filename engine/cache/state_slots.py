"""The GDN state slot pool: rows of the recurrent (fp32) and conv state tensors.

A slot is owned by one holder at a time: a running request (its write slot) or the radix cache
(a published checkpoint). Publishing a checkpoint hands the slot from the request to the tree,
an integer move; nothing is copied.
"""

from __future__ import annotations

from collections import deque

__all__ = ["SlotPool"]


class SlotPool:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, f"bad slot pool size {num_slots}"
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_free = [True] * num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        """Take one free slot, or ``None`` when none is free."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        assert not self._is_free[slot], f"state slot {slot} freed twice"
        self._is_free[slot] = True
        self._free.append(slot)
