"""On the trained built-in model (runtime/_trained_model), the GPU's CUDA-graph + fused path gives
the eager reference path's greedy tokens for 256 tokens on 8 prompts (issue 34).

Unlike the random demo model, this one has peaked logits, so the paths should agree token for
token. Where they part, the test asks the reference for its logits at that point (teacher-forced
on the common prefix) and accepts the difference only when the two tokens' logits there are
within bf16 rounding of each other (a tie), printing the figures; otherwise it is a bug.

The same check holds at concurrency: 4 and 16 requests of different lengths and ``max_tokens``
(so requests finish and pages change between steps) decoded together under async scheduling give
each request's tokens alone, ties explained the same way (issue 28).
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from trained_ties import first_unexplained, prompts

from phloem.engine import CacheConfig, Engine, EngineConfig, LoadConfig, RunnerConfig, SamplingParams, SchedulerConfig
from phloem.kernels.config import KernelConfig
from phloem.runtime.default_model import trained_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 256

GPU = EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16"), cache=CacheConfig(num_pages=512, num_state_slots=32),
                   scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16))  # fmt: skip


def gpu_engine(folder: Path, **sections: Any) -> Engine:
    """An engine of ``GPU``'s sections, ``sections`` replacing whole ones."""
    return Engine.from_pretrained(folder, GPU, **sections)


@pytest.mark.parametrize("n", [4, 16])
def test_concurrent_requests_give_each_requests_tokens_alone(n: int) -> None:
    folder = trained_model_path()
    base = prompts(folder)
    rng = random.Random(n)
    ids = [base[i % len(base)][: max(1, len(base[i % len(base)]) - rng.choice([0, 0, 3, 9]))] for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(16, 129), ignore_eos=True) for _ in range(n)]
    engine = gpu_engine(folder)
    assert engine.async_scheduling and engine.runner.graphs is not None
    batched = [o.token_ids for o in engine.generate(ids, params)]
    unexplained = []
    for k, (prompt, p, got) in enumerate(zip(ids, params, batched)):
        assert engine.cache.tree is not None
        engine.cache.tree.clear()  # alone means from scratch, not from the batch's cached prefix
        want = engine.generate([prompt], [p])[0].token_ids
        assert len(got) == len(want) == p.max_tokens
        line = first_unexplained(engine, prompt, got, want, f"request {k} of {n}")
        if line is not None:
            unexplained.append(line)
    assert not unexplained, unexplained


def test_graph_and_fused_path_gives_the_eager_references_256_tokens() -> None:
    folder = trained_model_path()
    ids = prompts(folder)
    assert len(ids) == 8
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    tested = [o.token_ids for o in gpu_engine(folder).generate(ids, params)]
    reference_engine = gpu_engine(folder, runner=RunnerConfig(enable_cuda_graph=False),
                                  cache=replace(GPU.cache, enable_prefix_caching=False),
                                  kernels=KernelConfig(triton_decode_attention=False))
    reference = [o.token_ids for o in reference_engine.generate(ids, params)]
    unexplained = []
    for n, (prompt, got, want) in enumerate(zip(ids, tested, reference)):
        assert len(got) == len(want) == NEW_TOKENS
        line = first_unexplained(reference_engine, prompt, got, want, f"prompt {n}")
        if line is not None:
            unexplained.append(line)
    assert not unexplained, unexplained
