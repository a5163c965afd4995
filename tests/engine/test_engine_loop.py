"""The engine loop driven by the toy model of ``tests/support/toy_model.py`` (closed-form answers)."""

from __future__ import annotations

import pytest
from toy_model import VOCAB, assert_pools_empty, expected, make_engine

from phloem.engine import CapacityExceeded, InvalidRequest, SamplingParams

PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 40)), [7] * 4, [9, 8], list(range(50, 63)), [11] * 17, [5, 6, 7]]


def test_batched_equals_alone_and_closed_form() -> None:
    params = SamplingParams(max_tokens=12)
    batched = make_engine().generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        alone = make_engine().generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids == expected(prompt, 12)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_long_prompt_is_chunked(caching: bool) -> None:
    engine = make_engine(budget=8, caching=caching)
    out = engine.generate([list(range(1, 40))], SamplingParams(max_tokens=3))[0]
    assert out.token_ids == expected(list(range(1, 40)), 3)
    # 39 prompt tokens in chunks of <= 8 → 5 prefill steps, then 2 decode steps; with the cache,
    # one more step computes the last token for the turn-end checkpoint, and the last chunk ends
    # one token early for the prompt-end checkpoint (issue 48: chunks 8, 8, 8, 8, 6, then 1).
    assert engine.runner.model.num_forwards == 5 + 2 + 2 * int(caching)


def test_pools_return_to_full_after_every_request() -> None:
    engine = make_engine()
    engine.generate(PROMPTS, SamplingParams(max_tokens=9))
    assert_pools_empty(engine)
    engine.generate(PROMPTS[:3], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=30), SamplingParams(max_tokens=2)])
    assert_pools_empty(engine)


def test_preemption_recomputes_to_the_same_tokens() -> None:
    # 10 pages of 4 tokens cannot hold 8 requests growing to ~20 tokens: preemption must happen.
    engine = make_engine(num_pages=10, num_slots=8, budget=64)
    prompts = [[i + 1] * 5 for i in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=14))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == expected(prompt, 14)
    assert_pools_empty(engine)


def test_slot_shortage_queues_instead_of_failing() -> None:
    engine = make_engine(num_slots=2)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == [expected(p, 4) for p in PROMPTS]
    assert_pools_empty(engine)


def test_stop_tokens_eos_and_ignore_eos() -> None:
    prompt = [1, 2, 3]
    free_run = expected(prompt, 10)
    stop = free_run[3]
    out = make_engine().generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1] and out.finish_reason == "stop"
    eos_engine = make_engine(eos=(stop,))
    assert eos_engine.generate([prompt], SamplingParams(max_tokens=10))[0].finish_reason == "stop"
    ignored = eos_engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [([], "prompt_token_ids"), ([1, VOCAB], "prompt_token_ids"), ([-1], "prompt_token_ids"), ([1] * 512, "prompt_token_ids"),
     ([1, True, 2], r"prompt_token_ids: .*got \[True\]"), ([3, 2.0], r"prompt_token_ids: .*got \[2\.0\]")],
    ids=["empty", "out-of-vocab", "negative", "over-context", "bool", "float"],
)
def test_bad_prompts_raise_and_engine_keeps_serving(prompt: list[int], field: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=field):
        engine.generate([[1, 2], prompt], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests(), "a rejected batch must enqueue nothing"
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids == expected([1, 2], 2)
    assert_pools_empty(engine)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_must_be_positive(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


def test_prompt_larger_than_the_pool_is_a_capacity_error() -> None:
    engine = make_engine(num_pages=4)
    with pytest.raises(CapacityExceeded, match="KV pages"):
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=1))
    assert engine.generate([[1]], SamplingParams(max_tokens=3))[0].token_ids == expected([1], 3)


def test_abort_frees_memory() -> None:
    engine = make_engine()
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.page_pool.num_used_pages > 0
    assert engine.abort_request(rid)
    assert not engine.abort_request(rid)
    assert_pools_empty(engine)
    assert not engine.has_unfinished_requests()
