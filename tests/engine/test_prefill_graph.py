"""The piecewise prefill graphs' plumbing (``engine.prefill_graph``) on CPU, pieces called instead of
replayed: chunked prefills beside decode rows, padded to token buckets, give the eager forward's
logits and tokens, and their KV serves a second turn's prefix hit as the eager path's does.

What the CPU cannot check (the capture itself) runs on the GPU: ``test_gpu_engine.py`` and
``test_gpu_concurrency.py`` compare the captured engine with the eager one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from logits_recorder import LogitsRecorder

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import CacheConfig, RunnerConfig, SchedulerConfig
from phloem.engine.prefill_graph import PrefillGraphRunner, prefill_buckets, seq_tiers

PAGE = 16
PROMPTS = [[(s * 131 + i * 17) % 256 for i in range(n)] for s, n in enumerate([5, 23, 40, 61, 2])]


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("Qwen3_5MoeForCausalLM")


def engine(path: Path, max_tokens: int) -> tuple[Engine, list[int]]:
    """A CPU engine whose non-decode steps of up to ``max_tokens`` tokens run through the pieces
    (0: none); returns it and a list that counts their runs."""
    eng = Engine.from_pretrained(path, cache=CacheConfig(page_size=PAGE, num_pages=96, num_state_slots=24),
                                scheduler=SchedulerConfig(max_num_batched_tokens=48))
    runs: list[int] = []
    if max_tokens:
        pad, pad_state = eng.page_pool.allocate(1), eng.slot_pool.allocate()
        assert pad is not None and pad_state is not None
        runner = PrefillGraphRunner(eng.runner.model, eng.runner.caches, max_tokens, pad[0] * PAGE, pad_state,  # type: ignore[arg-type]
                                    use_graphs=False)
        runner.capture()
        run = runner.run

        def counted(batch):  # type: ignore[no-untyped-def]
            runs.append(batch.num_tokens)
            return run(batch)

        runner.run = counted  # type: ignore[method-assign]
        eng.runner.prefill_graphs = runner
    return eng, runs


def turns(eng: Engine) -> tuple[list[list[int]], list[list[int]], list[int]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 3, 12, 5, 9)]
    first = [o.token_ids for o in eng.generate(PROMPTS, params)]
    follow = [p + t + [11, 12, 13] for p, t in zip(PROMPTS, first)]
    outs = eng.generate(follow, SamplingParams(max_tokens=6, ignore_eos=True))
    return first, [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_pieces_give_the_eager_forwards_tokens_and_logits(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = LogitsRecorder(monkeypatch)
    eager, _ = engine(path, 0)
    want = turns(eager)
    want_rows = recorder.rows
    recorder.rows = {}
    pieced, runs = engine(path, 48)
    got = turns(pieced)
    assert got == want
    assert sum(want[2]) > 0  # the second turns hit the first turns' pages and checkpoints
    # Chunks of 48 tokens, chunk tails beside decode rows, prompt tails: padded to their buckets.
    assert len(runs) >= 4 and any(n not in prefill_buckets(48) for n in runs)
    assert len(recorder.rows) == len(want_rows)
    for a, b in zip(recorder.rows.values(), want_rows.values()):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), rtol=1e-4, atol=1e-4)


def test_a_step_over_the_largest_bucket_runs_eagerly(path: Path) -> None:
    pieced, runs = engine(path, 16)
    out = pieced.generate([PROMPTS[3]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    eager, _ = engine(path, 0)
    assert out.token_ids == eager.generate([PROMPTS[3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
    # 61 tokens: 60 in chunks of 48 and 12 (the prompt-end checkpoint sits one token early), the
    # first over the largest bucket; the last prompt token runs beside the decode batch.
    assert runs == [12]


def test_buckets_and_config() -> None:
    assert prefill_buckets(2048)[-1] == 2048 and prefill_buckets(100) == [16, 32, 64, 100]
    assert seq_tiers(16) == [4, 16] and seq_tiers(64) == [4, 24, 64] and seq_tiers(72) == seq_tiers(2048) == [4, 24, 72]
    assert RunnerConfig().prefill_graph_tokens == 2048
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        RunnerConfig(prefill_graph_tokens=-1)
