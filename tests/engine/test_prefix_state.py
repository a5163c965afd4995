"""Spill and resume of a cached prefix: export to host tensors, drop from the device, import back.

Resumed generation must equal the never-spilled path token for token, and compute only what lies
past the checkpoint.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams
from phloem.storage import PinnedArena


CACHE = CacheConfig(page_size=16, num_pages=64, num_state_slots=8, checkpoint_interval=0)


def make(path: Path, cache: CacheConfig = CACHE) -> Engine:
    return Engine.from_pretrained(path, cache=cache)


def assert_pools_empty(engine: Engine) -> None:
    engine.cache.holds.clear()  # an import no request followed is held for one (engine.cache.holds)
    engine.cache.tree.clear()
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


@pytest.mark.parametrize("prompt_len", [21, 26], ids=["mid-page", "page-aligned"])
def test_export_clear_import_resumes_identically(tiny_checkpoint: Callable[..., Path], prompt_len: int) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    engine = make(path)
    prompt = [(7 * i + 3) % 256 for i in range(prompt_len)]
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids  # 27 or 32 tokens
    nxt = conv + [5, 6, 7]
    twin = make(path).generate([nxt], SamplingParams(max_tokens=10))[0]

    state = engine.export_prefix(conv)
    assert state is not None and state.num_tokens == len(conv)
    engine.cache.tree.clear()  # the session went idle and was dropped from the device
    assert engine.cached_prefix_len(nxt) == 0
    assert engine.import_prefix(state)
    resumed = engine.generate([nxt], SamplingParams(max_tokens=10))[0]
    assert resumed.num_cached_tokens == len(conv)
    assert resumed.token_ids == twin.token_ids
    assert_pools_empty(engine)


def test_an_export_into_the_pinned_arena_resumes_identically(tiny_checkpoint: Callable[..., Path]) -> None:
    """The spill's host copies land in the arena's ranges (``storage.pinned_arena``: pageable
    here, no CUDA), resume token for token, and give their ranges back once dropped."""
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    engine = make(path)
    arena = PinnedArena(1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    prompt = [(5 * i + 1) % 256 for i in range(23)]
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=5))[0].token_ids
    nxt = conv + [9, 8, 7]
    twin = make(path).generate([nxt], SamplingParams(max_tokens=10))[0]

    state = engine.export_prefix(conv, host_alloc=arena.alloc)
    assert state is not None and arena.fallbacks == 0
    base = arena._chunks[0].buffer.data_ptr()
    assert all(base <= t.data_ptr() < base + (1 << 20) for t in (state.kv, state.conv, state.ssm))
    assert arena.used_bytes >= state.nbytes
    engine.cache.tree.clear()
    assert engine.import_prefix(state)
    del state
    gc.collect()
    arena.collect()
    assert arena.used_bytes == 0
    resumed = engine.generate([nxt], SamplingParams(max_tokens=10))[0]
    assert resumed.num_cached_tokens == len(conv)
    assert resumed.token_ids == twin.token_ids
    assert_pools_empty(engine)


def test_an_export_past_a_full_arena_lands_in_pageable_memory_and_resumes_identically(
        tiny_checkpoint: Callable[..., Path]) -> None:
    """An arena with no range for the KV: the spill copies it into memory of its own (pageable,
    counted as a fallback) and the resume gives the same tokens."""
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    engine = make(path)
    arena = PinnedArena(512, chunk_bytes=512, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    prompt = [(3 * i + 2) % 256 for i in range(23)]
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=5))[0].token_ids
    nxt = conv + [7, 8, 9]
    twin = make(path).generate([nxt], SamplingParams(max_tokens=10))[0]

    state = engine.export_prefix(conv, host_alloc=arena.alloc)
    assert state is not None and arena.fallbacks >= 1
    base = arena._chunks[0].buffer.data_ptr()
    assert not base <= state.kv.data_ptr() < base + 512 and not state.kv.is_pinned()
    engine.cache.tree.clear()
    assert engine.import_prefix(state)
    resumed = engine.generate([nxt], SamplingParams(max_tokens=10))[0]
    assert resumed.num_cached_tokens == len(conv)
    assert resumed.token_ids == twin.token_ids
    assert_pools_empty(engine)


def test_import_into_a_tree_that_still_holds_the_prefix_frees_the_duplicates(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = make(tiny_checkpoint("Qwen3_5MoeForCausalLM"))
    prompt = list(range(40, 70))
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=3))[0].token_ids
    state = engine.export_prefix(conv)
    assert state is not None
    used = engine.page_pool.num_used_pages, engine.slot_pool.num_used_slots
    assert engine.import_prefix(state)
    assert (engine.page_pool.num_used_pages, engine.slot_pool.num_used_slots) == used
    assert_pools_empty(engine)


def test_import_without_room_takes_nothing(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    big = make(path)
    prompt = list(range(1, 60))
    conv = prompt + big.generate([prompt], SamplingParams(max_tokens=2))[0].token_ids
    state = big.export_prefix(conv)
    small = make(path, replace(CACHE, num_pages=3, num_state_slots=2))
    assert state is not None and not small.import_prefix(state)
    assert small.page_pool.num_free_pages == 3 and small.slot_pool.num_free_slots == 2


def test_import_rejects_a_foreign_layout(tiny_checkpoint: Callable[..., Path]) -> None:
    a = make(tiny_checkpoint("Qwen3_5MoeForCausalLM"))
    b = make(tiny_checkpoint("Qwen3_5MoeForCausalLM", num_layers=8))
    conv = [1, 2, 3] + a.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids
    state = a.export_prefix(conv)
    assert state is not None
    with pytest.raises(ValueError, match="expected kv"):
        b.import_prefix(state)
    assert b.page_pool.num_free_pages == b.page_pool.num_pages


def test_import_over_a_shared_prefix_writes_only_the_pages_past_it(tiny_checkpoint: Callable[..., Path]) -> None:
    """The tree holds the first pages of the spilled history (another request's shared prefix):
    the import keeps the tree's pages there and writes the rest; the resume equals the fresh path."""
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    engine = make(path)
    prompt = [(5 * i + 11) % 256 for i in range(50)]
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=5))[0].token_ids  # 55 tokens
    nxt = conv + [9, 8, 7]
    twin = make(path).generate([nxt], SamplingParams(max_tokens=8))[0]
    state = engine.export_prefix(conv)
    assert state is not None
    engine.cache.tree.clear()
    engine.generate([conv[:34]], SamplingParams(max_tokens=1))  # two full pages of it back in the tree
    held = engine.cache.tree.num_pages
    assert held >= 2
    assert engine.import_prefix(state)
    assert engine.cache.tree.num_pages == held + (len(conv) // 16 - 2)  # only the pages past them
    resumed = engine.generate([nxt], SamplingParams(max_tokens=8))[0]
    assert resumed.num_cached_tokens == len(conv)
    assert resumed.token_ids == twin.token_ids
    assert_pools_empty(engine)


class HeldFence:
    """A copy that has not ended until ``finished`` is set: counts the stream waits asked of it."""

    def __init__(self) -> None:
        self.finished = False
        self.waits = 0

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.waits += 1


def test_a_resume_whose_copy_is_still_queued_is_locked_and_waited_for(tiny_checkpoint: Callable[..., Path]) -> None:
    """While an import's copy runs (here: a fence held open), its prefix cannot be evicted, the
    request resuming on it orders its step after the copy, and an export waits for it too; once
    the copy ends the next step unlocks it."""
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    engine = make(path)
    prompt = [(3 * i + 1) % 256 for i in range(37)]
    conv = prompt + engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids
    nxt = conv + [4, 5, 6]
    twin = make(path).generate([nxt], SamplingParams(max_tokens=8))[0]
    state = engine.export_prefix(conv)
    assert state is not None
    engine.cache.tree.clear()

    fence = HeldFence()
    write = engine.runner.write_state_async
    engine.runner.write_state_async = lambda *args: (write(*args), fence)[1]  # type: ignore[method-assign]
    assert engine.import_prefix(state)
    assert len(engine.cache.imports) == 1
    engine.cache.tree.clear()  # eviction cannot take it while the copy runs
    assert engine.cached_prefix_len(nxt) == len(conv)

    request_id = engine.add_request(nxt, SamplingParams(max_tokens=8))
    outputs = engine.step()
    # Two waits: its admission on the imported checkpoint (the step reads the slot and pages), and
    # its prompt-end checkpoint's publish (its page table switches to the tree's pages: the import's).
    assert fence.waits == 2 and engine.cache.imports.num_waited == 2
    while not any(o.finished and o.request_id == request_id for o in outputs):
        outputs = engine.step()
    resumed = next(o for o in outputs if o.request_id == request_id)
    while engine.scheduler.has_unfinished():
        engine.step()
    assert resumed.num_cached_tokens == len(conv) and resumed.token_ids == twin.token_ids
    waits = fence.waits
    assert engine.export_prefix(conv) is not None
    assert fence.waits == waits + 1  # an export reads pool memory: it waits for every queued copy

    fence.finished = True
    engine.step()  # settles: the import's lock goes
    assert len(engine.cache.imports) == 0
    assert_pools_empty(engine)
