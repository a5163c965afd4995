"""Issue 48: a resent prompt is a full hit; branch-point checkpoints serve a shared prefix.

Toy-model tests (tests/support/toy_model.py re-reads every KV page and checks the GDN state
slot each step, page size 4) pin exact slots, pages and ref counts; the tiny Qwen3.5-MoE
checkpoint compares greedy tokens exactly across the fresh, branch-checkpoint and full-hit paths,
with chunked prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import Engine, SamplingParams
from phloem.engine.cache.radix import Checkpoint, RadixCache
from phloem.engine.config import CacheConfig, EngineConfig, SchedulerConfig


def test_a_resent_prompt_recomputes_only_its_last_token() -> None:
    engine = make_engine()
    prompt = list(range(3, 14))  # 11 tokens: the prompt-end checkpoint at 10, mid-page
    first = engine.generate([prompt], SamplingParams(max_tokens=5))[0]
    before = engine.runner.model.num_forwards
    again = engine.generate([prompt], SamplingParams(max_tokens=5))[0]
    assert again.num_cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids == expected(prompt, 5)
    # The last prompt token (its logits give the first output), 4 decodes, the finalize.
    assert engine.runner.model.num_forwards - before == 6
    assert_pools_empty(engine)


def test_the_second_sharer_publishes_a_branch_checkpoint_the_third_resumes_from() -> None:
    engine = make_engine(num_pages=64, num_slots=16, budget=64)
    tree = engine.cache.tree
    assert tree is not None
    shared = list(range(10, 31))  # 21 tokens: the branch point floors to 20
    a, b, c = shared + [1, 2, 3], shared + [7, 8, 9, 4], shared + [5, 6]
    out_a = engine.generate([a], SamplingParams(max_tokens=2))[0]
    a_pages = tree.match(a + out_a.token_ids + [0], 100).pages
    # A: slot 0 -> its prompt-end checkpoint (23), slot 1 -> its turn end (26).
    assert tree.checkpoints_created == 2 and engine.slot_pool.num_used_slots == 2
    out_b = engine.generate([b], SamplingParams(max_tokens=2))[0]
    assert out_b.num_cached_tokens == 0 and out_b.token_ids == expected(b, 2)
    branch = tree.match(b, 20)
    assert branch is not None and branch.num_tokens == 20
    ckpt = branch.checkpoint
    # B was admitted with slot 2, handed it to the tree at 20 and went on in slot 3.
    assert (ckpt.slot, ckpt.tail_page, ckpt.branch, ckpt.periodic) == (2, None, True, False)
    # The branch node split A's edge at 20: its five pages are A's (B's duplicates were freed).
    assert branch.pages == a_pages[:5] and branch.node.hits == 0
    assert (branch.node.lock_ref, branch.node.direct_ref) == (0, 0)
    assert tree.checkpoints_created == 5  # + B's branch, prompt end (24), turn end (27)
    out_c = engine.generate([c], SamplingParams(max_tokens=3))[0]
    assert out_c.num_cached_tokens == 20 and out_c.token_ids == expected(c, 3)
    assert branch.node.hits == 1 and (branch.node.lock_ref, branch.node.direct_ref) == (0, 0)
    # C resumed at the branch point, which was not a branch point any more: no new one.
    assert tree.checkpoints_created == 7
    assert_pools_empty(engine)


def test_no_branch_checkpoint_without_a_shared_kv_prefix_or_in_another_namespace() -> None:
    engine = make_engine(budget=64)
    tree = engine.cache.tree
    assert tree is not None
    shared = list(range(10, 31))
    engine.generate([shared + [1, 2]], SamplingParams(max_tokens=2), namespace="a")
    other = engine.generate([shared + [3, 4]], SamplingParams(max_tokens=2), namespace="b")[0]
    assert other.num_cached_tokens == 0
    # A's KV proves nothing to B: B published no branch checkpoint, and A has none yet.
    assert tree.match(shared + [3, 4], 20, "b") is None and tree.match(shared + [1, 2], 20, "a") is None
    again = engine.generate([shared + [5, 5]], SamplingParams(max_tokens=2), namespace="a")[0]
    assert again.num_cached_tokens == 0  # A's own second request publishes one at 20:
    third = engine.generate([shared + [6, 6]], SamplingParams(max_tokens=2), namespace="a")[0]
    assert third.num_cached_tokens == 20 and third.token_ids == expected(shared + [6, 6], 2)
    assert tree.match(shared + [6, 6], 21, "a").checkpoint.namespace == "a"
    assert engine.cached_prefix_len(shared + [6, 6], "b") == 0 and engine.cached_prefix_len(shared + [6, 6]) == 0
    assert_pools_empty(engine)


def test_a_branch_checkpoint_is_skipped_when_no_slot_is_free() -> None:
    """Two requests share a prefix with a cached one and run side by side in a pool of three
    slots: both hold a slot, the tree's evictable checkpoints are all gone, and neither waits or
    fails for want of a slot for its optional branch checkpoint."""
    engine = make_engine(num_pages=64, num_slots=3, budget=64)
    shared = list(range(10, 31))
    engine.generate([shared + [1]], SamplingParams(max_tokens=2))
    prompts = [shared + [2, 3], shared + [4, 5, 6]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == [expected(p, 4) for p in prompts]
    assert engine.scheduler.num_preemptions == 0
    assert_pools_empty(engine)


def test_a_used_checkpoint_outlives_an_unused_one_of_the_same_cost() -> None:
    """Eviction weighs checkpoints by use: two periodic checkpoints of equal recompute cost, the
    one a request resumed from (``record_hit``) is promoted to the boundary kind; among boundary
    ones the cost is multiplied by one plus the hits."""
    slots: list[int] = []
    cache = RadixCache(4, lambda pages: None, slots.append, 10, 70)
    x, y = [1] * 8 + [2] * 8, [1] * 8 + [3] * 8  # no checkpoint above either: cost 16 each
    nx, _ = cache.insert(x, [0, 1, 2, 3], Checkpoint(1, None, branch=True))
    ny, _ = cache.insert(y, [0, 1, 4, 5], Checkpoint(2, None, branch=True))
    cache.record_hit(nx)
    assert (nx.hits, ny.hits) == (1, 0)
    cache.evict(0, 1, lambda: 0, lambda: len(slots))
    assert slots == [2]  # unused, cheap kind; x's (used, now the boundary kind) stays
    b1, _ = cache.insert([5] * 12, [6, 8, 9], Checkpoint(3, None))
    b2, _ = cache.insert([6] * 12, [10, 11, 12], Checkpoint(4, None))
    cache.record_hit(b1)
    cache.record_hit(b1)
    # Boundary kind, cost = tokens x (1 + hits): b2 12, x's branch 16 x 2, b1 12 x 3.
    cache.evict(0, 3, lambda: 0, lambda: len(slots))
    assert slots == [2, 4, 1]
    cache.evict(0, 4, lambda: 0, lambda: len(slots))
    assert slots == [2, 4, 1, 3] and nx.hits == 0 and b1.hits == 0


# --- Greedy tokens on the tiny Qwen3.5-MoE checkpoint --------------------------------------------

PAGE = 16


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("Qwen3_5MoeForCausalLM")


def real_engine(path: Path, caching: bool = True, budget: int = 256, split_min: int = 256) -> Engine:
    cache = CacheConfig(num_pages=96, num_state_slots=16, page_size=PAGE, checkpoint_interval=0,
                        enable_prefix_caching=caching, prompt_end_split_min_tokens=split_min)
    return Engine.from_pretrained(path, EngineConfig(cache=cache, scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 256 for i in range(n)]


@pytest.mark.parametrize("split_min", [256, 0], ids=["default", "split-every-prompt-end"])
@pytest.mark.parametrize("budget", [256, 24], ids=["one-chunk", "chunked"])
def test_fresh_branch_and_full_hit_paths_give_the_same_tokens(path: Path, budget: int, split_min: int) -> None:
    shared = tokens(70, 1)  # branch point at 64
    prompts = [shared + tokens(9, 2), shared + tokens(5, 3), shared + tokens(12, 4)]
    want = [o.token_ids for o in real_engine(path, caching=False, budget=budget).generate(
        prompts, SamplingParams(max_tokens=8))]
    eng = real_engine(path, budget=budget, split_min=split_min)
    got, cached = [], []
    for p in [*prompts, prompts[2], prompts[0]]:  # then two full resends
        out = eng.generate([p], SamplingParams(max_tokens=8))[0]
        got.append(out.token_ids)
        cached.append(out.num_cached_tokens)
    assert got == [*want, want[2], want[0]]
    # Fresh, fresh (publishes the branch point at 64), resumes there, then two resends: the
    # first prompt's is a full hit; the third's too when every prompt end is split, else (it
    # resumed and added 18 < 256 tokens: its checkpoint is at its very end) it resumes at 64.
    third_again = len(prompts[2]) - 1 if split_min == 0 else 64
    assert cached == [0, 0, 64, third_again, len(prompts[0]) - 1]
    assert eng.cache.tree.match(prompts[1], 64).checkpoint.branch
    assert eng.cache.tree is not None and eng.cache.tree.checkpoints_created >= 1
    eng.cache.tree.clear()
    assert (eng.page_pool.num_used_pages, eng.slot_pool.num_used_slots) == (0, 0)
