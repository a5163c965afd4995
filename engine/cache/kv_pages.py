"""The KV page pool of the full-attention layers: which pages are free.

Pages are owned by exactly one holder at a time, a running request (its private pages) or the
radix cache (shared, immutable pages); sharing is expressed by locking tree nodes, not by counting
references per page. The pool therefore only needs a free list plus an ownership bitmap that
catches double frees and leaks.

The tensor holding the pages lives in ``ModelCaches.kv``; this class hands out its row indices.
"""

from __future__ import annotations

from collections import deque

__all__ = ["PagePool"]


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0, f"bad pool shape {num_pages=} {page_size=}"
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` free pages, or return ``None`` (and take nothing) if too few are free."""
        if num_pages > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert not self._is_free[p], f"page {p} freed twice"
            self._is_free[p] = True
            self._free.append(p)
