"""Constrained decoding through the engine on the built-in model (random weights): every output
parses and validates because the grammar allowed nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from phloem.engine import CacheConfig, Engine, GrammarSpec, InvalidRequest, SamplingParams, SchedulerConfig
from phloem.runtime import ensure_default_model
from phloem.sessions import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "unit": {"enum": ["kg", "lb"]}}, "required": ["ok", "n", "unit"], "additionalProperties": False}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("constrained"))


def make(model_dir: Path, **options: Any) -> Engine:
    """An engine with small pools; ``options`` are whole sections (or device, dtype)."""
    return Engine.from_pretrained(model_dir, cache=CacheConfig(num_pages=128, num_state_slots=12), **options)


@pytest.mark.slow  # three grammar-constrained generations to a JSON end
def test_outputs_follow_the_schema_and_stop_at_its_end(model_dir: Path) -> None:
    engine = make(model_dir)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode("Reply in JSON:")
    params = [SamplingParams(max_tokens=300, grammar=GRAMMAR),
              SamplingParams(max_tokens=300, temperature=1.0, seed=7, grammar=GRAMMAR),
              SamplingParams(max_tokens=300, temperature=0.8, top_k=20, seed=8, grammar=GRAMMAR,
                             presence_penalty=1.0, logprobs=2)]
    for out in engine.generate([prompt] * 3, params):
        assert out.finish_reason == "stop" and out.token_ids[-1] in engine.model_config.eos_token_ids
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), SCHEMA)
    assert engine.cache.tree is not None
    engine.cache.tree.clear()
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages


def test_grammar_steps_are_queued_ahead_and_plain_requests_are_unchanged(model_dir: Path) -> None:
    engine = make(model_dir)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], plain)[0]
    assert engine.num_pipelined_steps == 12  # every decode step (11) and the turn-end finalize
    before = engine.num_pipelined_steps
    mixed = engine.generate([[5, 6, 7], [9, 10]], [plain, SamplingParams(max_tokens=300, grammar=GRAMMAR)])
    assert mixed[0].token_ids == alone.token_ids
    # Every decode step is queued ahead (its sampling waits for the tokens before) except the
    # one after the plain request finished; the turn-end finalize step is too.
    assert engine.num_pipelined_steps - before == len(mixed[1].token_ids) - 1


def test_penalties_and_min_tokens_give_the_synchronous_tokens_under_async_scheduling(model_dir: Path) -> None:
    # A biased token wins until its penalty (which counts the token just sampled) outweighs the bias.
    params = [SamplingParams(max_tokens=20, logit_bias=((7, 15.0),), frequency_penalty=2.0, repetition_penalty=1.1),
              SamplingParams(max_tokens=20, min_tokens=15, temperature=0.9, seed=4, logit_bias=((9, 2.0),)),
              SamplingParams(max_tokens=20, ignore_eos=True)]
    prompts = [[5, 6, 7, 5, 6], [9, 10], [11, 12, 13]]
    outs = {pipelined: make(model_dir, scheduler=SchedulerConfig(async_scheduling=pipelined)).generate(prompts, params)
            for pipelined in (False, True)}
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert len(outs[True][1].token_ids) >= 15
    assert 1 < outs[True][0].token_ids.count(7) < 20


def test_a_bad_grammar_is_refused_and_the_engine_keeps_serving(model_dir: Path) -> None:
    engine = make(model_dir)
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        engine.add_request([1, 2], SamplingParams(max_tokens=4, grammar=GrammarSpec("json_schema", '{"type": 5}')))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(max_tokens=4, logit_bias=((10**6, 1.0),)))
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"
    engine.grammar = None
    with pytest.raises(InvalidRequest, match="without a tokenizer"):
        engine.add_request([1, 2], SamplingParams(max_tokens=4, grammar=GRAMMAR))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grammar_penalties_and_logprobs_under_cuda_graphs(model_dir: Path) -> None:
    """The mask is applied to the graph's logits, outside the graph; greedy rows of a processed
    step take the argmax of the processed logits, not the graph's."""
    engine = make(model_dir, device="cuda", dtype="bfloat16", scheduler=SchedulerConfig(max_num_seqs=16))
    assert engine.runner.graphs is not None
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(f"Reply in JSON {i}:") for i in range(12)]
    params = [SamplingParams(max_tokens=300, grammar=GRAMMAR, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(8)]
    params += [SamplingParams(max_tokens=16, ignore_eos=True, logprobs=4),
               SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0),
               SamplingParams(max_tokens=16, ignore_eos=True, logit_bias=((17, 100.0),)),
               SamplingParams(max_tokens=16, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    for out in outs[:8]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(out.token_ids)), SCHEMA)
    assert outs[10].token_ids == [17] * 16
    assert max(outs[9].token_ids.count(t) for t in outs[9].token_ids) < 16
    # Greedy through the processed copy (logprobs) and through the graph's own argmax agree.
    [reported] = engine.generate([prompts[8]], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4))
    [plain] = engine.generate([prompts[8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert reported.token_ids == plain.token_ids
