"""Many requests at once on the GPU's default configuration: CUDA graphs, the split-KV Triton decode
attention, async scheduling, the prefix cache.

The model is the Qwen3.5-35B-A3B shape (its head dims, experts and vocabulary; dummy weights)
cut to 8 layers, so every kernel the large model runs runs here, with the same per-step
intermediates in the graphs' memory pool. Random logits at this shape are nearly flat (two
numerically different paths part at near-ties within a few tokens), so the checks are ones that
hold on them:

- async scheduling runs the same forwards on the same inputs as the synchronous engine: greedy
  tokens equal bit for bit, for batches whose requests have different lengths and ``max_tokens``
  (requests finish and pages change between steps) and for their second turns (prefix hits);
- a request's logits in a batch stay close to the same request's alone, up to where the two
  greedy paths part (and there the batched token is among the lone run's top 5);
- mixed and prefill steps replayed from the piecewise prefill graphs give logits close to the same
  steps run eagerly (the graphs pad to token buckets, which changes the GEMMs' shapes);
- the sessions layer over the engine loop, with 16 sessions that start at different times,
  append while others decode, fork, and cancel, finishes every turn with ids in the vocabulary
  and no failed step.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from logits_recorder import LogitsRecorder, assert_logits_follow

from phloem.engine import Engine, SamplingParams
from phloem.runtime.model_shapes import SHAPES, ensure_shape_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = "qwen3.5-35b-a3b"
LAYERS = 8
# ||logits(batched) - logits(alone)|| / ||logits(alone)||. Batched and one-token kernels sum in
# other orders, and on random weights an MoE router at a near-tie then picks another expert in
# some layer, which moves a row by more than bf16 rounding; a wrong page, slot or input id gives
# unrelated logits (~1.4); 0.05 failed on the H200. Which token a row picks is not checked here:
# random logits are flat (the top five within 0.2 of each other), so batched and lone greedy paths
# part after a step or two for no reason a test can tell from rounding. The trained model's token
# test does that (tests/engine/test_gpu_trained_model.py, concurrency).
REL_TOL = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = ensure_shape_model(SHAPE, tmp_path_factory.mktemp("data"))
    config = dict(SHAPES[SHAPE], num_hidden_layers=LAYERS)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    engine = Engine.from_pretrained(model_dir, load_format="dummy", device="cuda", dtype="bfloat16")
    assert engine.runner.graphs is not None and engine.runner.attn is not None and engine.runner.attn.triton_decode
    assert engine.async_scheduling and engine.runner.prefill_graphs is not None
    yield engine
    engine.close()


def mixed_batch(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.choice([1, 17, 200, 555, 1000, 2049]))] for _ in range(n)]
    # A distinct params object per request: the logits recorder tells requests apart by it.
    params = [SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], pipelined: bool) -> list[list[int]]:
    engine.async_scheduling = pipelined
    try:
        assert engine.cache.tree is not None
        engine.cache.tree.clear()
        return [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.async_scheduling = True


@pytest.mark.parametrize("n", [4, 16])
def test_async_scheduling_gives_the_synchronous_tokens_bitwise(engine: Engine, n: int) -> None:
    vocab = engine.model_config.vocab_size
    prompts, params = mixed_batch(n, vocab, seed=n)
    results = []
    for pipelined in (False, True):
        pipelined_before = engine.num_pipelined_steps
        first = run(engine, prompts, params, pipelined)
        follow = [p + t + [11, 12] for p, t in zip(prompts, first)]
        engine.async_scheduling = pipelined
        second = [o.token_ids for o in engine.generate(follow, SamplingParams(max_tokens=16, ignore_eos=True))]
        engine.async_scheduling = True
        assert (engine.num_pipelined_steps > pipelined_before) == pipelined
        results.append((first, second))
    assert all(0 <= t < vocab for part in results[1] for toks in part for t in toks)
    assert results[1] == results[0]


@pytest.mark.parametrize("n", [4, 16])
def test_batched_logits_follow_each_request_alone(engine: Engine, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts, params = mixed_batch(n, engine.model_config.vocab_size, seed=100 + n)
    recorder = LogitsRecorder(monkeypatch)
    batched = run(engine, prompts, params, pipelined=True)
    alone_params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params]
    alone = [run(engine, [prompt], [q], pipelined=True)[0] for prompt, q in zip(prompts, alone_params)]
    alone_rows = {id(p): recorder.rows[id(q)] for p, q in zip(params, alone_params)}
    # A queued step may sample a request once past its end (the id is dropped): not compared.
    got_rows = [recorder.rows[id(p)][: len(got)] for p, got in zip(params, batched)]
    want_rows = [alone_rows[id(p)][: len(want)] for p, want in zip(params, alone)]
    compared = assert_logits_follow(batched, alone, got_rows, want_rows, REL_TOL, "the request alone")
    assert compared >= n


def test_prefill_graphs_follow_the_eager_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same two turns with the piecewise prefill graphs and with every non-decode step eager:
    16 prompts of up to 120 tokens (one prefill step under the largest bucket), then each history
    plus two tokens (prefix hits: steps of a few tokens per request beside decode rows)."""
    rng = random.Random(11)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(1, 120))] for _ in range(16)]
    lengths = [rng.randrange(4, 40) for _ in prompts]
    recorder = LogitsRecorder(monkeypatch)
    runs: list[int] = []
    graphs = engine.runner.prefill_graphs
    assert graphs is not None
    replay = graphs.run

    def counted(batch):  # type: ignore[no-untyped-def]
        runs.append(batch.num_tokens)
        return replay(batch)

    def two_turns(histories: list[list[int]] | None) -> tuple[list[list[int]], list[list[int]], list[SamplingParams]]:
        """Both turns; the second over ``histories`` (the graphed run's: both runs' second turns
        read the same prompts even where a near-tie parted their first turns), else this run's."""
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        first = run(engine, prompts, params, pipelined=True)
        follow = histories or [p + t + [11, 12] for p, t in zip(prompts, first)]
        more = [SamplingParams(max_tokens=8, ignore_eos=True) for _ in prompts]
        return first, [o.token_ids for o in engine.generate(follow, more)], params + more

    monkeypatch.setattr(graphs, "run", counted)
    graphed = two_turns(None)
    engine.runner.prefill_graphs = None
    try:
        eager = two_turns([p + t + [11, 12] for p, t in zip(prompts, graphed[0])])
    finally:
        engine.runner.prefill_graphs = graphs
    assert len(runs) >= 2 and max(runs) <= graphs.max_tokens
    got, want = graphed[0] + graphed[1], eager[0] + eager[1]
    got_rows = [recorder.rows[id(p)][: len(t)] for p, t in zip(graphed[2], got)]
    want_rows = [recorder.rows[id(q)][: len(t)] for q, t in zip(eager[2], want)]
    assert assert_logits_follow(got, want, got_rows, want_rows, REL_TOL, "the eager steps") >= 32


def test_sixteen_sessions_on_the_engine_loop(engine: Engine, model_dir: Path, tmp_path: Path) -> None:
    from phloem.runtime import EngineClient
    from phloem.sessions import GenerateOptions, SessionConfig, SessionInput, SessionManager, Tokenizer, model_fingerprint

    vocab = engine.model_config.vocab_size
    tokenizer = Tokenizer.from_pretrained(model_dir)
    client = EngineClient(engine)
    client.start()
    config = SessionConfig(data_dir=tmp_path)
    owner = "owner"

    async def agent(m: SessionManager, i: int) -> int:
        rng = random.Random(i)
        await asyncio.sleep(0.05 * i)  # staggered arrivals
        s = await m.create(owner, content=SessionInput(input_ids=tuple(rng.randrange(10, vocab) for _ in range(300 + 97 * i))))
        turns = 0
        for t in range(3):
            opts = GenerateOptions(max_tokens=8 + rng.randrange(24), temperature=0.0, ignore_eos=True)
            gen = await m.append(owner, s.session_id, SessionInput(input_ids=tuple(rng.randrange(10, vocab) for _ in range(40))), opts)
            if i % 5 == 4 and t == 1:
                await asyncio.sleep(0.02)
                gen.cancel()  # a cancelled turn commits what it has
            result = await gen.result()
            assert all(0 <= tok < vocab for tok in result.output_ids)
            turns += 1
            if t == 0 and i % 4 == 0:
                (child,) = await m.fork(owner, s.session_id)
                opts = GenerateOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
                gen = await m.append(owner, child.session_id, SessionInput(input_ids=(11, 12, 13)), opts)
                forked = await gen.result()
                assert len(forked.output_ids) == 12 and all(0 <= tok < vocab for tok in forked.output_ids)
                assert forked.usage.cached_tokens > 0
        return turns

    async def main() -> None:
        m = SessionManager(client, tokenizer, config, model_fingerprint=model_fingerprint(model_dir))
        await m.start()
        try:
            done = await asyncio.gather(*(agent(m, i) for i in range(16)))
            assert done == [3] * 16
        finally:
            await m.close()
        stats = await client.stats()
        assert stats.num_failed_steps == 0

    pipelined_before = engine.num_pipelined_steps
    try:
        asyncio.run(main())
    finally:
        asyncio.run(client.shutdown())
    assert engine.num_pipelined_steps > pipelined_before
