"""Request memory: the KV page and GDN state-slot pools, the radix prefix cache, and their manager.

Modules::

    kv_pages     ``PagePool``: the free list of full-attention KV pages
    state_slots  ``SlotPool``: the free list of GDN state slots (recurrent + conv state)
    radix        ``RadixCache``: the prefix tree of token runs, its checkpoints (a slot and a
                 tail page), namespaces and eviction
    manager      ``CacheManager``: admit / allocate / publish / release a request's memory
                 against the pools and the tree; ``CacheStats``
    memory       ``plan_pools`` / ``allocate_caches``: pool sizes from the memory left after
                 the weights, and the device tensors behind them
    sizing       the torch-free arithmetic: bytes of a page and a slot, the budget's split, and
                 ``estimate_memory`` (weights and pools per rank of a model not loaded)
    page_lists   ``PageListMirror``: each request's page ids kept as numpy arrays across steps

The names below load on first access, so importing one module does not load the others (nor
torch, for the pools and the tree).

May import: ``engine.request`` (the record whose memory it manages), ``engine.config``,
``engine.forward_batch`` (and torch, numpy); not ``engine.sampling``, the scheduler, the runner,
the models or ``engine.parallel`` (import-linter's engine layers contract checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports

if TYPE_CHECKING:
    from phloem.engine.cache.kv_pages import PagePool
    from phloem.engine.cache.manager import CacheManager, CacheStats
    from phloem.engine.cache.memory import PoolPlan, allocate_caches, plan_pools
    from phloem.engine.cache.page_lists import PageListMirror
    from phloem.engine.cache.radix import Checkpoint, PrefixMatch, RadixCache, RadixNode
    from phloem.engine.cache.sizing import MemoryEstimate, estimate_memory
    from phloem.engine.cache.state_slots import SlotPool

__all__ = [
    "CacheManager", "CacheStats", "Checkpoint", "MemoryEstimate", "PageListMirror", "PagePool", "PoolPlan",
    "PrefixMatch", "RadixCache", "RadixNode", "SlotPool", "allocate_caches", "estimate_memory", "plan_pools",
]

_LAZY = {
    "CacheManager": "phloem.engine.cache.manager",
    "CacheStats": "phloem.engine.cache.manager",
    "Checkpoint": "phloem.engine.cache.radix",
    "MemoryEstimate": "phloem.engine.cache.sizing",
    "PageListMirror": "phloem.engine.cache.page_lists",
    "PagePool": "phloem.engine.cache.kv_pages",
    "PoolPlan": "phloem.engine.cache.memory",
    "PrefixMatch": "phloem.engine.cache.radix",
    "RadixCache": "phloem.engine.cache.radix",
    "RadixNode": "phloem.engine.cache.radix",
    "SlotPool": "phloem.engine.cache.state_slots",
    "allocate_caches": "phloem.engine.cache.memory",
    "estimate_memory": "phloem.engine.cache.sizing",
    "plan_pools": "phloem.engine.cache.memory",
}


__getattr__ = lazy_exports(__name__, _LAZY)
