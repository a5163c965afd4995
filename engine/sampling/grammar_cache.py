"""The compiled-grammar cache: bounded by measured bytes, with a quota per owner.

Entries are keyed by the ``GrammarSpec`` itself, so only identical grammars share one (any owner
that sends the same schema gets the compiled grammar, a hit moves it to the most recent end).
Each entry is charged to the owner whose compile stored it. Storing ``size`` bytes for ``owner``
first evicts that owner's least recently used entries until its charge fits
``bytes_per_owner``, then anyone's least recently used entries until the total fits
``capacity_bytes``: one owner's new grammars push out its own old ones, never another owner's,
until the whole cache is full. A grammar larger than the owner's quota is not kept.

Not thread-safe: ``GrammarBackend`` calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["GrammarCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    size: int
    owner: str | None


class GrammarCache(Generic[K, V]):
    """An LRU map of ``K`` to ``V`` bounded in bytes overall and per owner (module docstring).

    Args:
        capacity_bytes: the sum of the entries' sizes, at most.
        bytes_per_owner: the sum of one owner's entries' sizes, at most (<= capacity_bytes).
    """

    def __init__(self, capacity_bytes: int, bytes_per_owner: int) -> None:
        assert 0 < bytes_per_owner <= capacity_bytes, f"quota {bytes_per_owner}, capacity {capacity_bytes}"
        self.capacity_bytes = capacity_bytes
        self.bytes_per_owner = bytes_per_owner
        self._entries: OrderedDict[K, _Entry[V]] = OrderedDict()
        self._owner_bytes: dict[str | None, int] = {}
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.value

    def owner_bytes(self, owner: str | None) -> int:
        """Bytes charged to ``owner``."""
        return self._owner_bytes.get(owner, 0)

    def put(self, key: K, value: V, size: int, owner: str | None) -> bool:
        """Keep ``value`` under ``key``, charged ``size`` bytes to ``owner``, evicting as the
        module docstring says. A key already present is replaced (its charge moves to ``owner``).

        Returns:
            False when ``size`` exceeds the owner's quota (nothing was kept or evicted).
        """
        if size > self.bytes_per_owner:
            return False
        self._remove(key)
        for victim in [k for k, e in self._entries.items() if e.owner == owner]:
            if self.owner_bytes(owner) + size <= self.bytes_per_owner:
                break
            self._remove(victim)
            self.evictions += 1
        while self.bytes + size > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1
        self._entries[key] = _Entry(value, size, owner)
        self._owner_bytes[owner] = self.owner_bytes(owner) + size
        self.bytes += size
        return True

    def _remove(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.bytes -= entry.size
        left = self._owner_bytes[entry.owner] - entry.size
        if left:
            self._owner_bytes[entry.owner] = left
        else:
            del self._owner_bytes[entry.owner]
