"""Imports whose copy is still queued: what they write, and when the engine's stream must wait.

An asynchronous import (``engine.transfer.prefix_export.import_prefix`` with a fenced writer)
publishes its prefix in the radix tree at once, so the append behind it is admitted as a hit,
while the copy into its pages and state slot still runs on a side stream. Until the copy ends:

- the tree node stays locked, so eviction cannot hand its pages or slot to another request
  (a write on the engine's stream racing the copy);
- any work on the engine's stream that reads those pages or that slot waits on the copy's fence
  first: a request admitted on the imported checkpoint (``CacheManager.admit``: its first step
  reads the slot and the pages, the tail page's copy-on-write reads the tail), a request that
  publishes onto the imported path and switches its page table to the tree's pages
  (``CacheManager._publish``), and whatever drains the engine (``Engine.drain`` calls
  ``wait_all``: exports, transfers, aborts).

``settle`` (every engine step) unlocks the imports whose copy has ended. Only the pages the
import adopted are tracked: positions the tree already held keep the tree's pages and the
import's duplicates are neither written nor kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from phloem.engine.cache.radix import RadixCache, RadixNode
from phloem.engine.copy_fence import CopyFence

__all__ = ["ImportFences"]


@dataclass(slots=True)
class _Pending:
    node: RadixNode
    fence: CopyFence
    pages: frozenset[int]
    slot: int | None


class ImportFences:
    def __init__(self, tree: RadixCache | None) -> None:
        self._tree = tree
        self._pending: list[_Pending] = []
        self.num_waited = 0  # times the engine's stream waited on a copy not yet done (for tests and stats)

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, node: RadixNode, fence: CopyFence, pages: Iterable[int], slot: int | None) -> None:
        """Track a queued copy into ``pages`` and ``slot`` (published at ``node``, locked until done)."""
        assert self._tree is not None, "an import needs the prefix cache"
        self._tree.lock(node)
        self._pending.append(_Pending(node, fence, frozenset(pages), slot))

    def settle(self) -> None:
        """Unlock the imports whose copy has ended."""
        if self._pending:
            self._pending = [p for p in self._pending if not self._finish_if_done(p)]

    def wait_for(self, pages: Iterable[int], slot: int | None = None) -> None:
        """Order the engine's stream after every pending copy into ``pages`` or ``slot``."""
        if not self._pending:
            return
        wanted = set(pages)
        for p in self._pending:
            if (slot is not None and p.slot == slot) or not p.pages.isdisjoint(wanted):
                self._wait(p)
        self.settle()

    def wait_all(self) -> None:
        """Order the engine's stream after every pending copy (before reading pool memory wholesale)."""
        for p in self._pending:
            self._wait(p)
        self.settle()

    def _wait(self, p: _Pending) -> None:
        if not p.fence.done():
            p.fence.wait()
            self.num_waited += 1

    def _finish_if_done(self, p: _Pending) -> bool:
        if not p.fence.done():
            return False
        assert self._tree is not None
        self._tree.unlock(p.node)
        return True
