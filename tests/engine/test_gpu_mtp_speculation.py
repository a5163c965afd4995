"""On CUDA, MTP speculative decoding gives the plain engine's greedy tokens (issue 50, on the GPU).

The trained built-in model (its own MTP layer) in bf16: 256 tokens on each of the 8 prompts of
``trained_ties``, one at a time (batch 1) and all together (batch 8), drafting 1, 2 and 3 tokens
a step, against a plain engine with CUDA graphs and async scheduling. The speculating engine
keeps CUDA graphs for its plain steps and runs its speculative steps eagerly
(``engine.speculative``): the verify is a small prefill chunk (FlashInfer's prefill wrapper, the
chunked GDN kernel) where the plain engine's step is a graph of the one-token kernels, so the
two may part at a tie; a departure is accepted only at a tie of the plain engine's
teacher-forced logits (``trained_ties.first_unexplained``), any other is a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trained_ties import first_unexplained, prompts

from phloem.engine import CacheConfig, Engine, EngineConfig, LoadConfig, SamplingParams, SchedulerConfig
from phloem.engine.config import SpeculativeConfig
from phloem.runtime.builtin_model import trained_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 256
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
GPU = EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16"), cache=CacheConfig(num_pages=512, num_state_slots=32),
                   scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16))  # fmt: skip


def engine_for(k: int) -> Engine:
    """``GPU``'s engine on the trained model, drafting ``k`` tokens a step (0: plain)."""
    spec = SpeculativeConfig("mtp", k) if k else SpeculativeConfig()
    return Engine.from_pretrained(trained_model_path(), GPU, speculative=spec)


@pytest.fixture(scope="module")
def plain() -> tuple[Engine, list[list[int]], list[list[int]]]:
    """The plain engine (graphs, async scheduling), the prompts and its tokens for them, batched."""
    engine = engine_for(0)
    assert engine.runner.graphs is not None and engine.async_scheduling
    ids = prompts(trained_model_path())
    return engine, ids, [o.token_ids for o in engine.generate(ids, PARAMS)]


def unexplained(reference: Engine, ids: list[list[int]], tested: list[list[int]], want: list[list[int]],
                label: str) -> list[str]:  # fmt: skip
    lines = []
    for n, (prompt, got, exp) in enumerate(zip(ids, tested, want)):
        assert len(got) == len(exp) == NEW_TOKENS
        line = first_unexplained(reference, prompt, got, exp, f"{label}, prompt {n}")
        if line is not None:
            lines.append(line)
    return lines


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_greedy_tokens_follow_plain_at_batch_1_and_8(k: int, plain) -> None:
    reference, ids, want = plain
    engine = engine_for(k)
    spec = engine.speculator
    assert spec is not None and engine.runner.attn is not None and engine.runner.graphs is not None
    assert not engine.async_scheduling
    alone = [engine.generate([p], PARAMS)[0].token_ids for p in ids]
    accepted = spec.stats.mean_accepted_length
    print(f"\nmtp:{k} on CUDA, batch 1: mean accepted length {accepted:.2f} over {spec.stats.steps} steps")
    assert engine.cache.tree is not None
    engine.cache.tree.clear()  # the batch from scratch, not from the single runs' cached prefixes
    steps = spec.stats.steps
    batched = [o.token_ids for o in engine.generate(ids, PARAMS)]
    assert spec.stats.steps > steps
    bad = unexplained(reference, ids, alone, want, f"mtp:{k} batch 1")
    bad += unexplained(reference, ids, batched, want, f"mtp:{k} batch 8")
    assert not bad, bad
    assert accepted > 1.3  # the trained MTP layer is accepted (CPU fp32: 1.7-3.4, docs/benchmarks.md)


def test_plain_steps_replayed_from_graphs_feed_the_mtp_layer(plain) -> None:
    """A repetition penalty makes every step with its request run plain, so while it decodes the
    greedy request's steps replay the decode graphs; the MTP layer must still see their rows
    (``ModelRunner.hidden_hook`` after ``CudaGraphRunner.run``): its pending rows end where the
    request's computed tokens do, and the greedy request's tokens are the plain engine's."""
    reference, ids, want = plain
    engine = engine_for(2)
    spec = engine.speculator
    assert spec is not None and engine.runner.graphs is not None
    greedy = engine.add_request(ids[0], SamplingParams(max_tokens=64, ignore_eos=True))
    engine.add_request(ids[1], SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.2))
    tokens: dict[str, list[int]] = {}
    checked = 0
    while engine.has_unfinished_requests():
        plain_steps = spec.stats.plain_steps
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        if engine.last_step_kind != "decode" or spec.stats.plain_steps == plain_steps:
            continue
        for req in engine.scheduler.running:
            rows, first = spec.pending[req.request_id]
            missed = f"{req.request_id}: the MTP layer missed a graph step's row"
            assert first + rows.shape[0] == req.num_computed_tokens, missed
            checked += 1
    assert checked >= 20  # two requests over most of the penalized one's 24 plain decode steps
    assert spec.stats.steps > 0  # the greedy request speculates once the penalized one is done
    assert len(tokens[greedy]) == 64
    line = first_unexplained(reference, ids[0], tokens[greedy], want[0][:64], "graph-fed mtp:2")
    assert line is None, line
