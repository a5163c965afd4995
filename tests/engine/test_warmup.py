"""``Engine.warm_up``: the steps it runs reach every kind of step serving uses, and it leaves the
engine exactly as a fresh one (same tokens, same cache hits, every page and slot free, counters
at zero). On CPU nothing compiles; the GPU test checks a first request after it compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from phloem.engine.scheduler import SchedulerOutput

CONFIG = EngineConfig(cache=CacheConfig(page_size=16, num_pages=256, num_state_slots=24),
                      scheduler=SchedulerConfig(max_num_batched_tokens=64))
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(30, 100))]


def step_shapes(engine: Engine) -> list[tuple[int, int]]:
    """Records ``(prefill tokens, decode rows)`` of every step the scheduler plans."""
    shapes: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        out = schedule()
        decode = sum(1 for r, n in zip(out.requests, out.num_new_tokens)
                     if n == 1 and r.num_computed_tokens >= r.num_prompt_tokens)
        shapes.append((sum(out.num_new_tokens) - decode, decode))
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return shapes


@pytest.mark.slow  # warms up an engine beside a fresh one
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "no-cache"])
def test_warm_up_leaves_the_engine_as_a_fresh_one(prefix_caching: bool, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    fresh = Engine.from_pretrained(path, CONFIG, cache=replace(CONFIG.cache, enable_prefix_caching=prefix_caching))
    warmed = Engine.from_pretrained(path, CONFIG, cache=replace(CONFIG.cache, enable_prefix_caching=prefix_caching))
    shapes = step_shapes(warmed)
    report = warmed.warm_up(show_progress=False)
    # Async scheduling plans steady decode steps outside ``schedule``: at least as many steps ran.
    assert report.num_requests == 8 and report.num_steps >= len(shapes) > 0
    assert report.num_prompt_tokens == 99 + 115 + (1 + 7 + 100 + 300) + 20 + 37
    assert not warmed.has_unfinished_requests()
    assert warmed.page_pool.num_free_pages == fresh.page_pool.num_free_pages
    assert warmed.slot_pool.num_free_slots == fresh.slot_pool.num_free_slots
    assert warmed.cache_stats() == fresh.cache_stats()
    assert warmed.scheduler.num_preemptions == 0 and warmed.num_pipelined_steps == fresh.num_pipelined_steps
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3)]
    for _ in range(2):  # the second round hits the cache the first left
        expected, got = fresh.generate(PROMPTS, params), warmed.generate(PROMPTS, params)
        assert [(o.token_ids, o.num_cached_tokens) for o in got] == [(o.token_ids, o.num_cached_tokens) for o in expected]


def test_warm_up_reaches_every_kind_of_step(tiny_checkpoint: Callable[..., Path]) -> None:
    # Synchronous scheduling: every step goes through ``schedule``, where the spy sees it.
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3NextForCausalLM"), CONFIG,
                                    scheduler=replace(CONFIG.scheduler, async_scheduling=False))
    shapes = step_shapes(engine)
    engine.warm_up(show_progress=False)
    budget = 64
    assert (budget, 0) in shapes, "a full prefill chunk"
    assert any(0 < p < budget and p % 2 and d == 0 for p, d in shapes), "an odd chunk over KV history"
    assert any(p > 0 and d > 0 for p, d in shapes), "a step that prefills beside a decode"
    assert any(p == 0 and d >= 4 for p, d in shapes), "a decode batch"
    assert any(p == 0 and d == 1 for p, d in shapes), "a single decode"
    assert engine.cache_stats().prompt_tokens == 0


def test_warm_up_fits_a_small_context_and_pool(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5ForCausalLM"), cache=CacheConfig(page_size=16, num_pages=16, num_state_slots=8),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_model_len=48))
    report = engine.warm_up(show_progress=False)
    # No room for the prefix round (the long prompt fills the window): the other seven run.
    assert report.num_requests == 7
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_on_a_gpu_leaves_the_tokens_and_the_graphs_alone(tmp_path: Path) -> None:
    """The real thing the warm-up is for: on CUDA (Triton kernels, FlashInfer, CUDA graphs) a
    warmed engine answers exactly as a fresh one, its pools as full. (The built-in model: its
    head_dim 64 is one FlashInfer's prefill kernels are built for; the tests' 32 is not.)"""
    from phloem.runtime.default_model import ensure_default_model

    path = ensure_default_model(tmp_path)
    # The chunked round's prompt is 1.5 step budgets; with the prefix round's 16 tokens and output it
    # must fit the built-in model's 8,192-token window, which the CUDA default budget (8,192) does not.
    options = dict(device="cuda", dtype="bfloat16", cache=CacheConfig(num_pages=4096, num_state_slots=32),
                   scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=16))
    fresh, warmed = Engine.from_pretrained(path, **options), Engine.from_pretrained(path, **options)
    report = warmed.warm_up(show_progress=False)
    assert report.num_requests == 8 and warmed.cache_stats() == fresh.cache_stats()
    assert warmed.page_pool.num_free_pages == fresh.page_pool.num_free_pages
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.9, seed=3)]
    expected, got = fresh.generate(PROMPTS, params), warmed.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
