"""When a speculating engine runs plain: a decode batch over ``SpeculativeConfig.max_batch_size``
runs plain steps, with the plain tokens, and the counters say how many steps did what."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import (
    DEFAULT_MAX_VERIFY_TOKENS, CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig,
)

PROMPTS = [list(range(3, 20)), [5, 9, 2], list(range(60, 71)), [7] * 6]
# Different lengths: the batch shrinks from 4 to 1 as requests finish.
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (16, 4, 8, 12)]
SECTIONS = dict(cache=CacheConfig(page_size=4, num_pages=128, num_state_slots=16),
                scheduler=SchedulerConfig(max_num_batched_tokens=64))


def _engine(path: Path, spec: SpeculativeConfig) -> Engine:
    return Engine.from_pretrained(path, EngineConfig(speculative=spec), dtype="float32", **SECTIONS)


@pytest.mark.slow  # three engines on a tiny checkpoint
@pytest.mark.parametrize("k", [1, 2])
def test_batch_over_the_limit_runs_plain_with_plain_tokens(k: int, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM", mtp=True)
    plain = [o.token_ids for o in _engine(path, SpeculativeConfig()).generate(PROMPTS, PARAMS)]
    limited = _engine(path, SpeculativeConfig("mtp", k, max_verify_tokens=2 * (k + 1)))
    assert limited.speculator is not None and limited.speculator.max_batch_size == 2
    assert [o.token_ids for o in limited.generate(PROMPTS, PARAMS)] == plain
    stats = limited.speculation_stats()
    assert stats is not None
    # 4 and 3 requests decode plain; once at most 2 are left, they speculate.
    assert stats.over_batch_steps >= 2 and stats.steps > 0
    assert stats.plain_steps >= stats.over_batch_steps
    assert sum(stats.emitted_lengths) == stats.request_steps
    assert sum(n * c for n, c in enumerate(stats.emitted_lengths)) == stats.emitted_tokens
    assert stats.drafted_tokens >= stats.accepted_tokens >= 0
    # Without a limit every decode step of the same run speculates.
    free = _engine(path, SpeculativeConfig("mtp", k))
    assert [o.token_ids for o in free.generate(PROMPTS, PARAMS)] == plain
    free_stats = free.speculation_stats()
    assert free_stats is not None and free_stats.over_batch_steps == 0 and free_stats.steps > stats.steps


def test_max_verify_tokens_sets_the_largest_speculating_batch() -> None:
    assert SpeculativeConfig("mtp", 3).max_batch_size == DEFAULT_MAX_VERIFY_TOKENS // 4 == 32
    assert SpeculativeConfig("mtp", 1).max_batch_size == 64
    assert SpeculativeConfig("mtp", 2, max_verify_tokens=3).max_batch_size == 1
    assert SpeculativeConfig().max_batch_size == 0
    with pytest.raises(ValueError, match=r"max_verify_tokens: expected at least num_draft_tokens \+ 1 = 4"):
        SpeculativeConfig("mtp", 3, max_verify_tokens=3)
    with pytest.raises(ValueError, match="max_verify_tokens: expected an integer"):
        SpeculativeConfig("mtp", 3, max_verify_tokens=12.5)  # type: ignore[arg-type]


def test_serve_flags_combine_the_method_and_the_limit() -> None:
    from phloem.cli.options import config_from_args

    both = config_from_args({"engine.speculative": SpeculativeConfig.parse("mtp:3"),
                             "engine.speculative.max_verify_tokens": 40})
    assert both.engine.speculative == SpeculativeConfig("mtp", 3, max_verify_tokens=40)
    alone = config_from_args({"engine.speculative.max_verify_tokens": 40})
    assert alone.engine.speculative == SpeculativeConfig(max_verify_tokens=40)
    assert config_from_args({}).engine.speculative == SpeculativeConfig()
