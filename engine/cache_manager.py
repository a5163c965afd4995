"""Memory of running requests: KV pages and GDN state slots, checked before they are committed.

The scheduler talks to this class only through check/act pairs (``can_admit``/``admit``,
``allocate_pages``) and ``release``; it never touches the pools directly. The radix prefix cache
plugs in here: ``admit`` is where a request picks up a cached prefix, ``release`` is where a
finished request hands its pages and final state to the tree.
"""

from __future__ import annotations

from phloem.engine.kv_pages import PagePool
from phloem.engine.request import Request
from phloem.engine.state_slots import SlotPool

__all__ = ["CacheManager"]


class CacheManager:
    def __init__(self, page_pool: PagePool, slot_pool: SlotPool) -> None:
        self.page_pool = page_pool
        self.slot_pool = slot_pool

    @property
    def page_size(self) -> int:
        return self.page_pool.page_size

    def admit(self, req: Request) -> bool:
        """Give a waiting request its write slot. Returns False (holding nothing) if none is free."""
        assert req.write_slot is None and not req.page_ids, f"request {req.request_id} already holds memory"
        slot = self.slot_pool.allocate()
        if slot is None:
            return False
        req.write_slot = slot
        req.read_slot = None
        req.has_state = False
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        return True

    def allocate_pages(self, req: Request, num_new_tokens: int) -> bool:
        """Make ``req.page_ids`` cover ``num_computed_tokens + num_new_tokens`` positions.

        Returns False (allocating nothing) when the pool has too few free pages.
        """
        needed = self.page_pool.pages_for(req.num_computed_tokens + num_new_tokens) - len(req.page_ids)
        if needed <= 0:
            return True
        pages = self.page_pool.allocate(needed)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def release(self, req: Request) -> None:
        """Return everything ``req`` holds to the pools (finish, abort or preemption)."""
        self.page_pool.free(req.page_ids)
        req.page_ids = []
        if req.write_slot is not None:
            self.slot_pool.free(req.write_slot)
        req.write_slot = None
        req.read_slot = None
        req.has_state = False

    def max_pages_for_one_request(self) -> int:
        return self.page_pool.num_pages
