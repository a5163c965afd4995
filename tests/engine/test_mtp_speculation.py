"""MTP speculative decoding is lossless: greedy tokens with ``mtp:1..3`` equal those without it.

On the trained built-in model (a real MTP layer: most drafts are accepted, so stops and
``max_tokens`` land inside accepted runs) and on tiny random checkpoints of the three
architectures (drafts mostly rejected: the rollback path), with batches of different lengths,
chunked prefill, prefix hits and requests that do not speculate (``engine.speculative``).
Each lossless case takes seconds on the 2-core CPU: they are marked slow.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import Engine
from phloem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from phloem.engine.sampling.params import SamplingParams
from phloem.runtime.builtin_model import trained_model_path

ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
TEXTS = (
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "<|im_start|>user\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n",
    "The module provides a simple way to parse command-line arguments, and the class",
    "import os\nimport sys\n\n\ndef main(argv):\n",
)


def _engine(path: Path, k: int, **sections) -> Engine:
    spec = SpeculativeConfig("mtp", k) if k else SpeculativeConfig()
    return Engine.from_pretrained(path, EngineConfig(speculative=spec), dtype="float32", **sections)


def _tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


# --- the trained built-in model -------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_model_path())
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def trained_plain(trained_prompts) -> list[list[int]]:
    return _tokens(_engine(trained_model_path(), 0), trained_prompts, SamplingParams(max_tokens=64))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_trained_model_greedy_tokens_equal_plain(k: int, trained_prompts, trained_plain) -> None:
    engine = _engine(trained_model_path(), k)
    # One at a time (batch 1), then all together (a batch of different lengths).
    alone = [_tokens(engine, [p], SamplingParams(max_tokens=64))[0] for p in trained_prompts]
    assert alone == trained_plain
    accepted = engine.speculator.stats.mean_accepted_length
    print(f"\nmtp:{k} mean accepted length (tokens per request per step) on the trained model: {accepted:.2f}")
    assert accepted > 1.3  # a real MTP layer: substantial acceptance
    batched = _engine(trained_model_path(), k)
    assert _tokens(batched, trained_prompts, SamplingParams(max_tokens=64)) == trained_plain
    assert batched.speculator.stats.steps > 0


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_trained_model_stop_token_and_max_tokens_inside_accepted_runs(k: int, trained_prompts, trained_plain) -> None:
    engine = _engine(trained_model_path(), k)
    for prompt, plain in zip(trained_prompts, trained_plain):
        for cut in (3, 6, 11):
            # max_tokens mid-run: the plain run's first ``cut`` tokens exactly.
            assert _tokens(engine, [prompt], SamplingParams(max_tokens=cut))[0] == plain[:cut]
            if cut >= len(plain):
                continue
            # A stop token inside a run: the plain run up to its first occurrence.
            stop = plain[cut]
            want = plain[: plain.index(stop) + 1]
            got = _tokens(engine, [prompt], SamplingParams(max_tokens=64, stop_token_ids=(stop,)))[0]
            assert got == want
    assert engine.speculator.stats.mean_accepted_length > 1.3


@pytest.mark.slow
def test_trained_model_chunked_prefill_and_prefix_hit(trained_prompts, trained_plain) -> None:
    engine = _engine(trained_model_path(), 3, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    assert _tokens(engine, trained_prompts, SamplingParams(max_tokens=64)) == trained_plain
    # A second request sharing the first's prompt and output: a prefix hit past the MTP-drafted tokens.
    follow = trained_prompts[0] + trained_plain[0][:20]
    plain = _tokens(_engine(trained_model_path(), 0), [follow], SamplingParams(max_tokens=32))
    out = engine.generate([follow], SamplingParams(max_tokens=32))[0]
    assert out.num_cached_tokens > 0
    assert out.token_ids == plain[0]


@pytest.mark.slow
def test_requests_that_do_not_speculate_run_plain(trained_prompts) -> None:
    """Penalties, a logit bias and ``min_tokens`` change the logits with every token drafted: a
    step with such a request runs plain (sampled, seeded, grammar and logprobs requests do
    speculate: tests/engine/test_mtp_speculative_sampling.py)."""
    params = [
        SamplingParams(max_tokens=24),
        SamplingParams(max_tokens=24, logit_bias=((11, 3.0),)),
        SamplingParams(max_tokens=24, min_tokens=20, temperature=0.8, seed=7),
        SamplingParams(max_tokens=24, repetition_penalty=1.2),
    ]
    plain = _tokens(_engine(trained_model_path(), 0), trained_prompts, params)
    engine = _engine(trained_model_path(), 3)
    assert _tokens(engine, trained_prompts, params) == plain
    # Alone, each is still its plain self, and none of its steps speculated.
    for prompt, p, want in zip(trained_prompts[1:], params[1:], plain[1:]):
        before = engine.speculator.stats.steps
        assert _tokens(engine, [prompt], p)[0] == want
        assert engine.speculator.stats.steps == before


class _EagerDecodeGraphs:
    """Stands in for ``CudaGraphRunner`` where CUDA graphs do not run (here): ``run`` computes a
    decode step eagerly and keeps its final hidden states, as a replay leaves them in the graph's
    pool, so the runner takes its graph branch (``ModelRunner._forward``) for every decode step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.hidden: torch.Tensor | None = None

    def max_batch_size(self) -> int:
        return 64

    def run(self, inp, input_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden = self.runner.model.forward(self.runner.build_batch(inp), self.runner.caches)
        logits = self.runner.model.compute_logits(self.hidden)
        return logits, logits.argmax(dim=-1)

    def last_hidden(self) -> torch.Tensor:
        assert self.hidden is not None
        return self.hidden


@pytest.mark.slow
def test_plain_decode_steps_through_the_graph_branch_feed_the_mtp_layer(trained_prompts, trained_plain) -> None:
    """A penalized request makes every step it is in run plain, so the greedy request beside it
    decodes through the runner's graph branch; the MTP layer must still see those rows: its
    pending rows end where each request's computed tokens do, and the greedy tokens are plain.
    (tests/engine/test_gpu_mtp_speculation.py checks the same with real CUDA graphs.)"""
    engine = _engine(trained_model_path(), 2)
    engine.runner.graphs = _EagerDecodeGraphs(engine.runner)
    spec = engine.speculator
    greedy = engine.add_request(trained_prompts[2], SamplingParams(max_tokens=32))
    engine.add_request(trained_prompts[3], SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.2))
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
            assert first + rows.shape[0] == req.num_computed_tokens, f"{req.request_id}: a graph step's row missed"
            checked += 1
    assert checked >= 10 and spec.stats.steps > 0
    assert tokens[greedy] == trained_plain[2][:32]


def test_speculation_off_allocates_no_mtp_kv() -> None:
    plain = _engine(trained_model_path(), 0)
    spec = _engine(trained_model_path(), 1)
    trunk = len(plain.model_config.full_attention_layers)
    assert plain.runner.caches.kv.shape[0] == trunk and plain.speculator is None
    assert spec.runner.caches.kv.shape[0] == trunk + 1
    assert not spec.async_scheduling


# --- tiny checkpoints of the three architectures ----------------------------------------------

TINY_PROMPTS = [list(range(3, 40)), [5, 9, 2], list(range(60, 81)), [7] * 12]
TINY_CACHE = CacheConfig(page_size=4, num_pages=256, num_state_slots=24)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoints_greedy_tokens_equal_plain(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(arch, mtp=True)
    sched = SchedulerConfig(max_num_batched_tokens=16)  # chunked prefill of the longer prompts
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 13, 17, 9)]
    plain = _tokens(_engine(path, 0, cache=TINY_CACHE, scheduler=sched), TINY_PROMPTS, params)
    follow = TINY_PROMPTS[0] + plain[0][:6]
    plain_follow = _tokens(_engine(path, 0, cache=TINY_CACHE, scheduler=sched), [follow], params[0])
    for k in (1, 2, 3):
        engine = _engine(path, k, cache=TINY_CACHE, scheduler=sched)
        assert _tokens(engine, TINY_PROMPTS, params) == plain, f"mtp:{k}"
        assert engine.speculator.stats.steps > 0
        out = engine.generate([follow], params[0])[0]  # a prefix hit
        assert out.num_cached_tokens > 0 and out.token_ids == plain_follow[0], f"mtp:{k}"
        # A stop token inside the run, batch 1.
        stop = plain[2][5]
        want = plain[2][: plain[2].index(stop) + 1]
        got = _tokens(engine, [TINY_PROMPTS[2]], SamplingParams(max_tokens=17, stop_token_ids=(stop,)))[0]
        assert got == want, f"mtp:{k}"


@pytest.mark.slow
def test_context_limit_inside_a_run(trained_prompts) -> None:
    """A request reaching ``max_model_len`` stops exactly where a plain one does; the last steps
    draft fewer tokens rather than verify past the limit."""
    prompt = trained_prompts[2]
    sched = SchedulerConfig(max_model_len=len(prompt) + 13)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = _tokens(_engine(trained_model_path(), 0, scheduler=sched), [prompt], params)
    for k in (1, 3):
        engine = _engine(trained_model_path(), k, scheduler=sched)
        out = engine.generate([prompt], params)[0]
        assert out.token_ids == plain[0] and out.finish_reason == "length"
        assert engine.speculator.stats.steps > 0


@pytest.mark.slow
def test_spill_and_resume_between_speculating_and_plain_engines(trained_prompts, trained_plain) -> None:
    """A spilled prefix carries the trunk's KV and state only (the TP=1 layout): it moves between
    speculating and plain engines both ways, and the follow-up turn is the plain one."""
    conv = trained_prompts[1] + trained_plain[1]
    follow = conv + trained_prompts[3]
    params = SamplingParams(max_tokens=32)
    want = _tokens(_engine(trained_model_path(), 0), [follow], params)[0]
    for src_k, dst_k in ((3, 0), (0, 2), (2, 2)):
        src = _engine(trained_model_path(), src_k)
        src.generate([trained_prompts[1]], SamplingParams(max_tokens=64))
        state = src.export_prefix(conv)
        assert state is not None
        dst = _engine(trained_model_path(), dst_k)
        assert dst.import_prefix(state)
        out = dst.generate([follow], params)[0]
        assert out.num_cached_tokens > 0 and out.token_ids == want, (src_k, dst_k)


@pytest.mark.slow
def test_heldout_acceptance_on_the_trained_model() -> None:
    """docs/benchmarks.md's CPU-measured acceptance: 4 held-out windows (128-token prompts at 1/8,
    3/8, 5/8, 7/8 of ``tools/train/prepare.py``'s held-out corpus), 64 new tokens, batch 1."""
    import importlib.util
    import sys

    from transformers import AutoTokenizer

    train = Path(__file__).resolve().parents[2] / "tools" / "train"
    sys.path.insert(0, str(train))
    try:
        spec = importlib.util.spec_from_file_location("train_prepare", train / "prepare.py")
        prepare = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(prepare)
    finally:
        sys.path.remove(str(train))
    _, held = prepare.split(prepare.build_documents(prepare.DEFAULT_STDLIB_BYTES, prepare.DEFAULT_TRANSCRIPTS))
    ids = AutoTokenizer.from_pretrained(trained_model_path()).encode(prepare.EOT.join(held) + prepare.EOT)
    prompts = [ids[len(ids) * i // 8 : len(ids) * i // 8 + 128] for i in (1, 3, 5, 7)]
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = [_tokens(_engine(trained_model_path(), 0), [p], params)[0] for p in prompts]
    for k in (1, 2, 3):
        engine = _engine(trained_model_path(), k)
        assert [_tokens(engine, [p], params)[0] for p in prompts] == plain
        accepted = engine.speculator.stats.mean_accepted_length
        print(f"\nmtp:{k} held-out mean accepted length: {accepted:.2f}")
        assert accepted > 1.3
