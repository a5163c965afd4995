"""The same greedy answer on every prefix-cache path, on a tiny random Qwen3.5-MoE checkpoint.

Each path (hit on a page boundary, mid-page, at a turn-end checkpoint, at a periodic checkpoint,
at a prompt-end checkpoint,
concurrent sharers, multi-turn extension, chunked prefill, eviction then recompute) is compared
token for token with the fresh path: an engine without a prefix cache computing the whole history.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig

PAGE = 16


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("Qwen3_5MoeForCausalLM")


CACHE = CacheConfig(page_size=PAGE, num_pages=64, num_state_slots=16, checkpoint_interval=0)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=256)


def engine(path: Path, cache: CacheConfig = CACHE, scheduler: SchedulerConfig = SCHEDULER) -> Engine:
    return Engine.from_pretrained(path, cache=cache, scheduler=scheduler)


def fresh(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = engine(path, replace(CACHE, enable_prefix_caching=False)).generate(prompts, SamplingParams(max_tokens=n))
    return [o.token_ids for o in outs]


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 256 for i in range(n)]


@pytest.mark.parametrize(("prompt_len", "out_len"), [(10, 6), (10, 5), (16, 1)], ids=["page-boundary", "mid-page", "one-token"])
def test_turn_checkpoint_hit_equals_fresh(path: Path, prompt_len: int, out_len: int) -> None:
    eng = engine(path)
    prompt = tokens(prompt_len, 1)
    first = eng.generate([prompt], SamplingParams(max_tokens=out_len))[0]
    conv = prompt + first.token_ids + tokens(7, 2)
    second = eng.generate([conv], SamplingParams(max_tokens=12))[0]
    assert second.num_cached_tokens == prompt_len + out_len
    assert second.token_ids == fresh(path, [conv], 12)[0]


@pytest.mark.parametrize("prompt_len", [21, 32], ids=["mid-page-tail-copy", "page-boundary"])
def test_prompt_end_checkpoint_serves_another_continuation(path: Path, prompt_len: int) -> None:
    """A stateless client resends the prompt followed by something other than what was generated
    (a re-rendered answer, a retried turn): the prompt-end checkpoint serves the whole prompt."""
    prompt = tokens(prompt_len, 6)
    results = {}
    for flag in (True, False):
        eng = engine(path, replace(CACHE, checkpoint_prompt_end=flag))
        first = eng.generate([prompt], SamplingParams(max_tokens=5))[0]
        retry = prompt + [(first.token_ids[0] + 1) % 256] + tokens(8, 7)
        results[flag] = eng.generate([retry], SamplingParams(max_tokens=12))[0]
        # Emptying the cache returns every page (tail copies included) and slot: nothing leaked.
        assert eng.cache.tree is not None
        eng.cache.tree.clear()
        assert (eng.page_pool.num_used_pages, eng.slot_pool.num_used_slots) == (0, 0)
    # One token before the end (issue 48: a resend of the bare prompt hits it too).
    assert results[True].num_cached_tokens == prompt_len - 1
    assert results[False].num_cached_tokens == 0  # only the turn-end checkpoint, past the prompt
    assert results[True].token_ids == results[False].token_ids == fresh(path, [retry], 12)[0]


def test_periodic_checkpoint_hit_equals_fresh(path: Path) -> None:
    eng = engine(path, replace(CACHE, checkpoint_interval=16), SchedulerConfig(max_num_batched_tokens=64))
    shared = tokens(40, 3)
    eng.generate([shared + tokens(5, 4)], SamplingParams(max_tokens=2))
    probe = shared[:37] + tokens(3, 5)
    out = eng.generate([probe], SamplingParams(max_tokens=12))[0]
    assert out.num_cached_tokens == 32
    assert out.token_ids == fresh(path, [probe], 12)[0]


def test_concurrent_sharers_and_fork_branches_equal_fresh(path: Path) -> None:
    eng = engine(path, replace(CACHE, checkpoint_interval=16))
    shared = tokens(50, 6)
    prompts = [shared + tokens(3, 7), shared + tokens(9, 8), shared]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outs] == fresh(path, prompts, 10)
    # Fork: three branches continue the same finished conversation (mid-page tail copied each time).
    conv = prompts[0] + outs[0].token_ids
    branches = [conv + tokens(2, s) for s in (9, 10, 11)]
    bouts = eng.generate(branches, SamplingParams(max_tokens=10))
    assert all(b.num_cached_tokens == len(conv) for b in bouts)
    assert [b.token_ids for b in bouts] == fresh(path, branches, 10)


def test_multi_turn_extension_equals_fresh(path: Path) -> None:
    eng = engine(path, scheduler=SchedulerConfig(max_num_batched_tokens=24))  # chunked prefill on the first turn
    history = tokens(60, 12)
    for turn in range(4):
        out = eng.generate([history], SamplingParams(max_tokens=6))[0]
        assert out.token_ids == fresh(path, [history], 6)[0]
        assert out.num_cached_tokens == (0 if turn == 0 else len(history) - 4)
        history = history + out.token_ids + tokens(4, 20 + turn)


def test_eviction_then_recompute_equals_fresh(path: Path) -> None:
    eng = engine(path, replace(CACHE, num_pages=12, num_state_slots=4))
    prompts = [tokens(40, 30 + i) for i in range(5)]
    for p in prompts:
        eng.generate([p], SamplingParams(max_tokens=4))
    assert eng.cache_stats().checkpoints_evicted > 0
    again = eng.generate([prompts[0] + tokens(2, 99)], SamplingParams(max_tokens=8))[0]
    assert again.token_ids == fresh(path, [prompts[0] + tokens(2, 99)], 8)[0]
    eng.cache.tree.clear()
    assert eng.page_pool.num_free_pages == eng.page_pool.num_pages
    assert eng.slot_pool.num_free_slots == eng.slot_pool.num_slots
