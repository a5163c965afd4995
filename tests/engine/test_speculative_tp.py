"""MTP speculation under tensor parallelism (CPU, gloo): TP=2 engines drafting ``mtp:1`` and
``mtp:2`` give the greedy tokens of a TP=1 engine without speculation.

Rank 1 runs every draft, verify, LM-head and rollback step alongside rank 0 through the plans
``engine.speculative_ranks`` sends; a worker that missed or reordered one would hang in a
collective or diverge. The tiny random checkpoints reject most drafts, so the rollback path
(snapshot, restore, rerun) runs on both ranks nearly every step; chunked prefill and a prefix hit
ride along.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from phloem.engine.step_plan import SpecOp, StepInputs, StepPlan, decode_plan, encode_plan

PROMPTS = [list(range(3, 40)), [5, 9, 2], list(range(60, 81))]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 9, 10)]
SECTIONS = dict(
    cache=CacheConfig(page_size=4, num_pages=192, num_state_slots=16),
    scheduler=SchedulerConfig(max_num_batched_tokens=16),  # the 37-token prompt prefills in chunks
)


def _engine(path: Path, k: int, tp: int) -> Engine:
    spec = SpeculativeConfig("mtp", k) if k else SpeculativeConfig()
    return Engine.from_pretrained(
        path, EngineConfig(speculative=spec), dtype="float32", parallel=ParallelConfig(tensor_parallel_size=tp),
        **SECTIONS,
    )


@pytest.mark.slow  # two-rank tensor-parallel process groups
@pytest.mark.parametrize("arch", ["Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_tp2_speculation_gives_tp1_plain_tokens(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(arch, mtp=True)
    plain_engine = _engine(path, 0, 1)
    plain = [o.token_ids for o in plain_engine.generate(PROMPTS, PARAMS)]
    follow = PROMPTS[0] + plain[0][:5]
    plain_follow = plain_engine.generate([follow], PARAMS[0])[0].token_ids
    for k in (1, 2):
        with _engine(path, k, 2) as engine:
            assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == plain, f"mtp:{k}"
            stats = engine.speculator.stats  # type: ignore[union-attr]
            assert stats.steps > 0 and stats.request_steps > stats.steps  # batched speculative steps ran
            out = engine.generate([follow], PARAMS[0])[0]
            assert out.num_cached_tokens > 0 and out.token_ids == plain_follow, f"mtp:{k}"


def test_spec_ops_round_trip_the_wire() -> None:
    inp = StepInputs([7, 8], [4, 5], [20, 21], [0, 2], [6], [3], [3], [True], (2,), [[5, 9]], [])
    plans = [
        StepPlan(((1, 2),), inp, spec=SpecOp("mtp")),
        StepPlan((), None, spec=SpecOp("logits", (6,))),
        StepPlan(((3, 4),), None, spec=SpecOp("snapshot", (2, 7, 9))),
        StepPlan((), None, spec=SpecOp("restore", (0, 2, 7, 11))),
        StepPlan((), inp, device_ids=True),
    ]
    for plan in plans:
        assert decode_plan(encode_plan(plan)) == plan
