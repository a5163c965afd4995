"""A MoE whose shared expert has another FFN size than the routed experts (Hugging Face's
Qwen3.5-MoE and Qwen3-Next configs allow it) loads, takes the unfused path and generates
transformers' greedy tokens; at TP=2 and under expert parallelism too (CPU, gloo).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, ParallelConfig, SamplingParams, SchedulerConfig
from phloem.engine.models._moe import SparseMoe

ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12], list(range(30, 70))]
# The routed experts' FFN is 32 (tests/conftest.py); 48 cannot be expert row E of their tensors.
SHARED = 48
OPTIONS: dict[str, object] = dict(cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=32))


def moe_blocks(engine: Engine) -> list[SparseMoe]:
    return [m for m in engine.runner.model.modules() if isinstance(m, SparseMoe)]


@pytest.mark.slow  # transformers beside the engine
@pytest.mark.parametrize("arch", ARCHS)
def test_other_shared_expert_size_matches_transformers(
    arch: str, tiny_checkpoint: Callable[..., Path], hf_model: Callable[..., torch.nn.Module]
) -> None:
    path = tiny_checkpoint(arch, shared_expert_size=SHARED)
    hf = hf_model(arch, shared_expert_size=SHARED)
    engine = Engine.from_pretrained(path, **OPTIONS)
    blocks = moe_blocks(engine)
    assert blocks and not any(b.fused_shared for b in blocks)
    assert blocks[0].shared_expert.gate_up_proj.weight.shape == (2 * SHARED, 64)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=16))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist(), f"{arch} diverged on a prompt of {len(prompt)}"


def test_same_size_keeps_the_fused_shared_expert(tiny_checkpoint: Callable[..., Path]) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), **OPTIONS)
    blocks = moe_blocks(engine)
    assert blocks and all(b.fused_shared and b.router.weight.shape[0] == b.num_experts + 1 for b in blocks)


def test_fused_checkpoint_layout_loads_too(tiny_checkpoint: Callable[..., Path]) -> None:
    """Fused expert tensors and the published ``model.language_model.*`` layout, same tokens."""
    plain = tiny_checkpoint("Qwen3_5MoeForCausalLM", shared_expert_size=SHARED)
    other = tiny_checkpoint("Qwen3_5MoeForCausalLM", layout="language_model", experts="fused",
                            shared_expert_size=SHARED)
    params = SamplingParams(max_tokens=8)
    expected = Engine.from_pretrained(plain, **OPTIONS).generate(PROMPTS, params)
    got = Engine.from_pretrained(other, **OPTIONS).generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_tensor_and_expert_parallel_follow_tp1(expert_parallel: bool, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3NextForCausalLM", shared_expert_size=SHARED)
    params = SamplingParams(max_tokens=8)
    expected = Engine.from_pretrained(path, **OPTIONS).generate(PROMPTS, params)
    with Engine.from_pretrained(path, parallel=ParallelConfig(2, expert_parallel=expert_parallel), **OPTIONS) as tp2:
        got = tp2.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_a_shared_expert_size_the_ranks_cannot_split_is_a_clear_error(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3NextForCausalLM", shared_expert_size=33)
    with pytest.raises(ValueError, match="expected a divisor of shared_expert_intermediate_size=33, got 2"):
        Engine.from_pretrained(path, parallel=ParallelConfig(tensor_parallel_size=2), **OPTIONS)
