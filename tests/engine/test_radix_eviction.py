"""The radix cache's heap-based eviction frees exactly what a full scan per victim would, in order.

The reference below is the scan the cache used before (every node visited for every victim).
Random trees of conversations that share prefixes, with checkpoints (some with tail pages),
locked paths (``lock``) and pinned heads, are evicted under page-only and page+slot demands;
the sequence of freed pages and slots must be identical.
"""

from __future__ import annotations

import random

import pytest

from phloem.engine.cache.radix import Checkpoint, RadixCache, RadixNode


class ScanCache(RadixCache):
    """The reference: pick each victim by scanning every node."""

    def evict(self, num_pages: int, num_slots: int, free_page_count, free_slot_count) -> None:  # type: ignore[no-untyped-def]
        while free_page_count() < num_pages or free_slot_count() < num_slots:
            victim = self._scan(need_slots=free_slot_count() < num_slots)
            if victim is None:
                return
            self._free_victim(*victim)

    def _scan(self, need_slots: bool) -> tuple[RadixNode, bool] | None:
        best, choice = None, None
        for node in self._nodes():
            frees_a_page = not node.children or (node.checkpoint is not None and node.checkpoint.tail_page is not None)
            if node.checkpoint is not None and node.direct_ref == 0 and (need_slots or frees_a_page):
                freed = self.slot_bytes + (self.page_bytes if node.checkpoint.tail_page is not None else 0)
                rank = 0 if node.checkpoint.periodic else 1
                key = (rank, (node.depth - self._checkpoint_above(node)) / freed, node.last_access, node.node_id)
                if best is None or key < best:
                    best, choice = key, (node, True)
            elif node.checkpoint is None and not node.children and node.lock_ref == 0:
                key = (0, 0.0, node.last_access, node.node_id)
                if best is None or key < best:
                    best, choice = key, (node, False)
        return choice


def build(cls: type[RadixCache], seed: int) -> tuple[RadixCache, list[tuple[str, int]]]:
    """A random tree; returns it and the log its frees append to."""
    rng = random.Random(seed)
    freed: list[tuple[str, int]] = []
    cache = cls(4, lambda pages: freed.extend(("page", p) for p in pages), lambda s: freed.append(("slot", s)), 10, 70)
    pages, slots = iter(range(10**6)), iter(range(10**6))
    roots = [[rng.randrange(6) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    for _ in range(rng.randrange(5, 40)):
        history = list(rng.choice(roots))
        for _ in range(rng.randrange(1, 5)):
            history += [rng.randrange(6) for _ in range(rng.randrange(1, 11))]
            n = len(history)
            tail = next(pages) if n % 4 else None
            periodic = rng.random() < 0.3
            node, _ = cache.insert(history, [next(pages) for _ in range(n // 4)], Checkpoint(next(slots), tail, periodic))
            if rng.random() < 0.15:
                cache.lock(node)  # a running request or a pinned session head
            if rng.random() < 0.5:
                cache.match(history, n)  # touch: recency varies
    return cache, freed


@pytest.mark.parametrize("seed", range(40))
def test_heap_eviction_equals_a_scan_per_victim(seed: int) -> None:
    rng = random.Random(1000 + seed)
    heap, heap_log = build(RadixCache, seed)
    scan, scan_log = build(ScanCache, seed)
    assert heap_log == scan_log  # the inserts freed the same duplicates
    base = len(heap_log)
    for _ in range(3):
        pages, slots = rng.randrange(0, 40), rng.choice([0, 0, rng.randrange(1, 8)])
        for cache, log in ((heap, heap_log), (scan, scan_log)):
            start = len(log)
            cache.evict(pages, slots, lambda log=log, start=start: sum(k == "page" for k, _ in log[start:]),
                        lambda log=log, start=start: sum(k == "slot" for k, _ in log[start:]))  # fmt: skip
        assert heap_log == scan_log
    assert len(heap_log) > base, "the demands evicted nothing: the test would not test"
    # Clearing frees everything not locked, in the same order.
    heap.clear()
    scan.clear()
    assert heap_log == scan_log
    assert heap.num_pages == scan.num_pages and heap.num_checkpoints == scan.num_checkpoints


def test_a_mid_path_checkpoint_gives_up_its_tail_page_under_page_pressure() -> None:
    """A checkpoint with children frees no pages of the path, but its tail page is its own: when
    only pages are short, it goes (before, it stayed until its last child went, and a request
    alone in a small pool finished early for want of that page)."""
    freed: list[tuple[str, int]] = []
    cache = RadixCache(4, lambda pages: freed.extend(("page", p) for p in pages), lambda s: freed.append(("slot", s)), 10, 70)
    history = list(range(1, 24))
    cache.insert(history[:5], [0], Checkpoint(slot=1, tail_page=11))  # mid-page: a tail page
    head, _ = cache.insert(history, [0, 5, 6, 9, 12], Checkpoint(slot=0, tail_page=10))
    cache.lock(head)  # the running request holds the deeper checkpoint and the whole path
    cache.evict(1, 0, lambda: len(freed), lambda: 0)
    assert freed == [("slot", 1), ("page", 11)]
    assert cache.match(history, 6) is None and cache.match(history, 23) is not None


def test_periodic_checkpoints_go_before_boundary_ones_and_a_pinned_head_stays() -> None:
    """Slot pressure on one pinned conversation: a 40-token first turn with periodic checkpoints
    at 8 and 16 (cost 8 tokens each) and boundary ones at its prompt end (40) and turn ends (44, 48:
    cost 4 each, cheaper). The periodic ones go first, then the boundary ones cheapest first; the
    pinned head (52) never goes."""
    slots: list[int] = []
    cache = RadixCache(4, lambda pages: None, slots.append, 10, 70)
    history = list(range(1, 53))
    for depth, slot, periodic in ((8, 8, True), (16, 16, True), (40, 40, False), (44, 44, False), (48, 48, False)):
        cache.insert(history[:depth], list(range(depth // 4)), Checkpoint(slot, None, periodic))
    head, _ = cache.insert(history, list(range(13)), Checkpoint(52, None))
    cache.lock(head)
    cache.evict(0, 3, lambda: 0, lambda: len(slots))
    assert slots == [8, 16, 44]  # periodic (cost 8, then 24 once 8 is gone), then the cheapest boundary
    cache.evict(0, 10, lambda: 0, lambda: len(slots))
    assert slots == [8, 16, 44, 48, 40] and cache.match(history, 52) is not None
