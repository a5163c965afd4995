"""The step's token budget (the prefill chunk) defaults by device: 512 tokens on CPU, 8,192 on a
GPU (docs/configuration.md, "The prefill chunk", has the measurements); a given one wins."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig


def test_cpu_default_and_an_explicit_budget(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5ForCausalLM")
    engine = Engine.from_pretrained(path, cache=CacheConfig(num_pages=64, num_state_slots=8))
    assert engine.scheduler.config.max_num_batched_tokens == 512
    given = Engine.from_pretrained(path, cache=CacheConfig(num_pages=64, num_state_slots=8),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=96))
    assert given.scheduler.config.max_num_batched_tokens == 96
    prompt = [(i * 7) % 256 for i in range(600)]  # two chunks at the default budget
    params = SamplingParams(max_tokens=4)
    assert engine.generate([prompt], params)[0].token_ids == given.generate([prompt], params)[0].token_ids


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5ForCausalLM", dtype=torch.bfloat16), device="cuda")
    assert engine.scheduler.config.max_num_batched_tokens == 8192
