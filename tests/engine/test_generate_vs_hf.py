"""End-to-end greedy generation through ``Engine`` against Hugging Face ``generate``.

Tiny random checkpoints of the three architectures (built by ``tests/conftest.py``), fp32 on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig

ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], list(range(30, 70))]


CACHE = CacheConfig(page_size=16, num_pages=64, num_state_slots=16)
SCHEDULER = SchedulerConfig(max_num_batched_tokens=256)
UNCACHED = replace(CACHE, enable_prefix_caching=False)


def make(path: Path, cache: CacheConfig = CACHE, scheduler: SchedulerConfig = SCHEDULER) -> Engine:
    return Engine.from_pretrained(path, cache=cache, scheduler=scheduler)


def assert_pools_empty(engine: Engine) -> None:
    if engine.cache.tree is not None:
        engine.cache.tree.clear()
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


@pytest.mark.slow  # transformers' generate beside the engine
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_match_transformers(
    arch: str, tiny_checkpoint: Callable[..., Path], hf_model: Callable[..., torch.nn.Module]
) -> None:
    path = tiny_checkpoint(arch)
    hf = hf_model(arch)
    engine = make(path)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=32))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist(), f"{arch} diverged on prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length" and out.num_cached_tokens == 0
    assert_pools_empty(engine)


@pytest.mark.slow  # nine generations
def test_batched_eight_requests_equal_each_alone(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 16, 17, 33, 70, 5, 9]  # 70 > the 32-token budget below: chunked prefill
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=12)
    batched = make(path, UNCACHED, SchedulerConfig(max_num_batched_tokens=32)).generate(prompts, params)
    for prompt, out in zip(prompts, batched):
        alone = make(path, UNCACHED).generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    a = make(path).generate([PROMPTS[0]], p)[0].token_ids
    b = make(path).generate([PROMPTS[1], PROMPTS[0]], [SamplingParams(max_tokens=3), p])[1].token_ids
    assert a == b
    greedy = make(path).generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=7))[0].token_ids
    assert greedy == make(path).generate([PROMPTS[0]], SamplingParams(max_tokens=10, seed=8))[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(max_tokens=2), "prompt_token_ids"),
        ([1, 256], SamplingParams(max_tokens=2), "prompt_token_ids"),
        ([1] * 40, SamplingParams(max_tokens=2), "prompt_token_ids"),
    ],
    ids=["empty", "out-of-vocab", "over-context"],
)
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(
    prompt: list[int], params: SamplingParams, field: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    engine = make(tiny_checkpoint("Qwen3_5MoeForCausalLM"), scheduler=replace(SCHEDULER, max_model_len=32))
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].finish_reason == "length"
    assert_pools_empty(engine)
