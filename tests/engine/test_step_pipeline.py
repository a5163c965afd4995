"""Async scheduling (``engine.step_pipeline``): the next decode step is queued before the current
one's ids are read, and nothing observable changes but the overlap.

Each test runs the same workload on a synchronous and an async engine and compares tokens,
finish reasons, cached-token counts, forwards and pool accounting; ``num_pipelined_steps``
proves the async path actually ran (so a pipeline that silently never engages fails).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from toy_model import PROMPTS_FOR_PIPELINE, assert_pools_empty, expected, make_engine

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig


def run_both(make: Callable[[bool], Engine], work: Callable[[Engine], object]) -> tuple[object, Engine]:
    """``work`` on a sync and an async engine: returns the async result after checking equality."""
    sync_engine, async_engine = make(False), make(True)
    want, got = work(sync_engine), work(async_engine)
    assert got == want
    assert sync_engine.num_pipelined_steps == 0
    return got, async_engine


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_one_request_queues_every_decode_step(caching: bool) -> None:
    prompt, m = [1, 2, 3, 4, 5], 12

    def work(engine: Engine) -> object:
        out = engine.generate([prompt], SamplingParams(max_tokens=m))[0]
        return out.token_ids, out.finish_reason, engine.runner.model.num_forwards

    (ids, reason, forwards), engine = run_both(lambda a: make_engine(caching=caching, async_scheduling=a), work)
    assert ids == expected(prompt, m) and reason == "length"
    # Prefill, then m - 1 decode forwards (+1 turn-end finalize with the cache): no extra work;
    # with the cache, the prefill is cut one token before the prompt's end for the prompt-end
    # checkpoint (issue 48: a resend recomputes one token), +1.
    assert forwards == m + 2 * int(caching)
    # Every decode step is queued (the first behind the prefill that ends the prompt), and so is
    # the finalize.
    assert engine.num_pipelined_steps == m - 1 + int(caching)
    assert_pools_empty(engine)


@pytest.mark.parametrize("interval", [0, 8], ids=["no-interval", "interval-8"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_a_mixed_batch_equals_the_synchronous_engine(caching: bool, interval: int) -> None:
    """Staggered lengths, stop tokens, chunked prefill, periodic checkpoints, a slot shortage."""
    stops = {p[0]: expected(p, 20)[5] for p in PROMPTS_FOR_PIPELINE}
    params = [SamplingParams(max_tokens=3 + 4 * i, stop_token_ids=(stops[p[0]],) if i % 3 == 0 else ())
              for i, p in enumerate(PROMPTS_FOR_PIPELINE)]

    def work(engine: Engine) -> object:
        outs = engine.generate(PROMPTS_FOR_PIPELINE, params)
        stats = engine.cache_stats()
        return [(o.token_ids, o.finish_reason) for o in outs], stats.prompt_tokens, stats.cached_tokens

    make = lambda a: make_engine(caching=caching, interval=interval, budget=16, num_slots=6,  # noqa: E731
                                 async_scheduling=a)
    (outs, _, _), engine = run_both(make, work)
    for prompt, p, (ids, reason) in zip(PROMPTS_FOR_PIPELINE, params, outs):
        assert ids == expected(prompt, p.max_tokens, set(p.stop_token_ids))
    assert engine.num_pipelined_steps > 0
    assert_pools_empty(engine)


def test_a_prompt_end_checkpoint_is_not_overwritten_by_the_queued_step() -> None:
    """Chunks cut at every 4 tokens leave a 5-token prompt's last token to a one-token step that
    samples: a decode-shaped step after which the prompt-end checkpoint takes the write slot.
    The step after must not have been queued into that slot (the toy model asserts that its state
    agrees with its KV pages, and the next turn resumes from that checkpoint)."""
    prompt = [1, 2, 3, 4, 5]

    def work(engine: Engine) -> object:
        first = engine.generate([prompt], SamplingParams(max_tokens=20))[0]
        second = engine.generate([prompt + first.token_ids[:10] + [3]], SamplingParams(max_tokens=5))[0]
        return first.token_ids, second.token_ids, second.num_cached_tokens, engine.runner.model.num_forwards

    (first, second, cached, _), engine = run_both(lambda a: make_engine(interval=4, async_scheduling=a), work)
    assert first == expected(prompt, 20)
    assert second == expected(prompt + first[:10] + [3], 5)
    # A fresh prompt's prompt-end checkpoint sits one token before its end (issue 48); the
    # reservation for a queued step is exercised by a resumed turn's prompt end
    # (test_the_step_after_a_tool_result_is_queued).
    assert cached == len(prompt) - 1, "resumed from the prompt-end checkpoint"
    assert engine.num_pipelined_steps > 0
    assert_pools_empty(engine)


@pytest.mark.parametrize("append", [3, 5], ids=["tail-copy", "page-aligned"])
def test_the_step_after_a_tool_result_is_queued(append: int) -> None:
    """An agent's tool result prefilled beside a decoding request (a mixed step that ends its
    prompt) is followed by a queued decode step: it reads the state the prompt-end checkpoint
    takes over and writes a slot set aside for it (with a tail-page copy when the prompt ends
    mid-page). The checkpoint holds: the next turn resumes from it."""
    first, second = [1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25, 26, 27]

    def work(engine: Engine) -> object:
        earlier = engine.generate([second], SamplingParams(max_tokens=3))[0]
        turn = second + earlier.token_ids + [9] * append  # the tool result, over the cached turn
        decoding = engine.add_request(first, SamplingParams(max_tokens=30))
        tokens: dict[str, list[int]] = {decoding: []}
        for _ in range(4):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        appended = engine.add_request(turn, SamplingParams(max_tokens=10))
        tokens[appended] = []
        kinds, queued_after = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            kinds.append(engine.last_step_kind)
            queued_after.append(engine._queued is not None)
        mixed = kinds.index("mixed")
        if engine.async_scheduling:
            assert queued_after[mixed], "the decode step after the tool result is queued"
        nxt = engine.generate([turn + tokens[appended] + [5]], SamplingParams(max_tokens=4))[0]
        return tokens[decoding], tokens[appended], nxt.token_ids, nxt.num_cached_tokens, (turn, first)

    (decoded, answered, nxt, cached, (turn, first_prompt)), engine = run_both(
        lambda a: make_engine(async_scheduling=a), work)
    assert decoded == expected(first_prompt, 30)
    assert answered == expected(turn, 10)
    assert nxt == expected(turn + answered + [5], 4)
    assert cached == len(turn) + len(answered), "the turn-end checkpoint after the prompt-end one"
    assert_pools_empty(engine)


@pytest.mark.parametrize("arrival", ["tool-result", "resumed", "fresh-prompt"])
def test_a_request_arriving_mid_decode_joins_the_queued_step(arrival: str) -> None:
    """A request that arrives while decode steps are queued (an agent's tool result on its cached
    turn or on its turn spilled to the host, or a fresh prompt that fits the budget) is admitted
    into the next queued step, a mixed step: the pipeline does not stop for it. The tokens, the
    cache hits and the pools are those of the synchronous engine."""
    first, second = [1, 2, 3, 4, 5], [20, 21, 22, 23, 24, 25, 26, 27]
    pipeline: dict[str, int] = {}

    def work(engine: Engine) -> object:
        earlier = engine.generate([second], SamplingParams(max_tokens=3))[0]
        turn = second + earlier.token_ids
        prompt = turn + [9] * 5 if arrival != "fresh-prompt" else [30 + i for i in range(12)]
        spilled = None
        if arrival == "resumed":
            spilled = engine.export_prefix(turn)
            assert spilled is not None and engine.cache.tree is not None
            engine.cache.tree.clear()
        decoding = engine.add_request(first, SamplingParams(max_tokens=30))
        tokens: dict[str, list[int]] = {decoding: []}
        for _ in range(4):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        mixed_before = engine.num_pipelined_mixed_steps
        arrived = engine.add_request(prompt, SamplingParams(max_tokens=10), resume=spilled)
        tokens[arrived], cached, synchronous = [], 0, 0
        while engine.has_unfinished_requests():
            answered = bool(tokens[arrived])
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                cached = out.num_cached_tokens if out.request_id == arrived else cached
            synchronous += not answered and engine._queued is None
        pipeline.update(synchronous=synchronous, mixed=engine.num_pipelined_mixed_steps - mixed_before)
        return tokens[decoding], tokens[arrived], cached, prompt

    (decoded, answered, cached, prompt), engine = run_both(lambda a: make_engine(async_scheduling=a, budget=16), work)
    assert decoded == expected(first, 30)
    assert answered == expected(prompt, 10)
    assert cached == (0 if arrival == "fresh-prompt" else len(prompt) - 5)
    # A fresh prompt's first chunk stops one token short of its end (its prompt-end checkpoint):
    # the step after a chunk that samples nothing is not queued (module docstring).
    assert pipeline == {"synchronous": int(arrival == "fresh-prompt"), "mixed": 1}, "the arrival stopped the pipeline"
    assert_pools_empty(engine)


class LateArrival:
    """Two running requests (every seat of a 2-seat engine), then after ``warm_steps`` steps a
    third; counts the steps that ran while it waited with a step queued behind them (``mixed``:
    only queued steps with prefill rows)."""

    def __init__(self, running: list[tuple[list[int], int]], late: tuple[list[int], int], warm_steps: int,
                 mixed: bool) -> None:  # fmt: skip
        self.running, self.late, self.warm_steps, self.mixed = running, late, warm_steps, mixed
        self.queued_while_waiting: list[int] = []

    def __call__(self, engine: Engine) -> object:
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=n)) for prompt, n in self.running]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        for _ in range(self.warm_steps):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        late = engine.add_request(self.late[0], SamplingParams(max_tokens=self.late[1]))
        tokens[late], queued = [], 0
        while engine.has_unfinished_requests():
            waiting = bool(engine.scheduler.waiting)
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            step = engine._queued
            queued += waiting and step is not None and (not self.mixed or step.sched.kind != "decode")
        self.queued_while_waiting.append(queued)
        return [tokens[i] for i in ids], tokens[late], engine.scheduler.num_preemptions

    def run_both(self) -> tuple[object, Engine]:
        return run_both(lambda a: make_engine(async_scheduling=a, max_seqs=2), self)


def test_a_waiting_request_that_may_take_a_seat_runs_the_synchronous_step() -> None:
    """With every seat taken, a short request's admission may preempt a running one (a yielded
    seat): that is the synchronous path's, so no step is queued while it waits, and it takes
    the seat of the request that brought the most work."""
    long_prompt, short_prompt = list(range(10, 40)), [3, 4]
    work = LateArrival([(long_prompt, 40), ([1, 2], 40)], (short_prompt, 5), warm_steps=6, mixed=True)
    (outs, answered, preemptions), engine = work.run_both()
    assert outs == [expected(long_prompt, 40), expected([1, 2], 40)]
    assert answered == expected(short_prompt, 5)
    assert preemptions == 1, "the claimant took the long prompt's seat"
    assert work.queued_while_waiting == [0, 0] and engine.num_pipelined_mixed_steps == 0
    assert_pools_empty(engine)


def test_a_waiting_request_no_seat_is_yielded_to_keeps_the_decode_steps_queued() -> None:
    """With every seat taken, a request that brings no less work than the running ones (no seat
    is yielded to it) waits for a seat to free: meanwhile the decode steps stay queued, as the
    synchronous path would run them, and it is admitted once a request finishes."""
    prompts, waiting_prompt = [list(range(10, 16)), list(range(20, 26))], list(range(30, 40))
    work = LateArrival([(prompts[0], 12), (prompts[1], 30)], (waiting_prompt, 5), warm_steps=3, mixed=False)
    (outs, answered, preemptions), engine = work.run_both()
    assert outs == [expected(prompts[0], 12), expected(prompts[1], 30)]
    assert answered == expected(waiting_prompt, 5)
    assert preemptions == 0, "no seat was yielded: the waiting request brings the most work"
    # The sync engine queues nothing; the async one queued the decode steps while it waited (about
    # the 8 left to the first request; a step or two at the ends may run synchronously).
    queued = work.queued_while_waiting
    assert queued[0] == 0 and queued[1] >= 6, queued
    assert_pools_empty(engine)


def test_turn_end_checkpoints_land_and_the_next_turn_hits_them() -> None:
    def work(engine: Engine) -> object:
        conv, seen = [1, 2, 3, 4, 5, 6], []
        for turn in range(4):
            out = engine.generate([conv], SamplingParams(max_tokens=7 + turn))[0]
            seen.append((out.token_ids, out.num_cached_tokens))
            conv = conv + out.token_ids + [turn + 1] * 3
        return seen

    seen, engine = run_both(lambda a: make_engine(async_scheduling=a), work)
    # From turn 2 on, the whole previous conversation (prompt + answer) comes from the cache.
    conv_lens = [6]
    for ids, _ in seen[:-1]:
        conv_lens.append(conv_lens[-1] + len(ids) + 3)
    assert [cached for _, cached in seen] == [0] + [n - 3 for n in conv_lens[1:]]
    assert engine.num_pipelined_steps > 0
    assert_pools_empty(engine)


def test_seeded_sampling_draws_the_same_tokens() -> None:
    params = [SamplingParams(max_tokens=15, temperature=1.5, seed=s) for s in (1, 2, 3)]

    def work(engine: Engine) -> object:
        return [o.token_ids for o in engine.generate([[4, 5], [6], [7, 8, 9]], params)]

    _, engine = run_both(lambda a: make_engine(async_scheduling=a), work)
    assert engine.num_pipelined_steps > 0


@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_abort_while_a_step_is_queued_frees_everything(caching: bool) -> None:
    engine = make_engine(caching=caching)
    victim = engine.add_request([1, 2, 3], SamplingParams(max_tokens=40))
    other = engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=20))
    tokens: dict[str, list[int]] = {victim: [], other: []}
    for _ in range(6):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine._queued is not None, "a decode step is queued between steps"
    assert engine.abort_request(victim)
    done = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim, "nothing is reported for an aborted request"
            tokens[out.request_id] += out.new_token_ids
            done |= out.finished
    assert done and tokens[other] == expected([4, 5, 6, 7], 20)
    assert tokens[victim] == expected([1, 2, 3], len(tokens[victim]))
    assert_pools_empty(engine)


def test_real_checkpoint_greedy_tokens_equal_the_synchronous_engine(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    prompts = [[(7 * i + 3 * j) % 256 for j in range(5 + 6 * i)] for i in range(4)]

    def make(a: bool) -> Engine:
        return Engine.from_pretrained(path, cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16),
                                      scheduler=SchedulerConfig(max_num_batched_tokens=64, async_scheduling=a))

    def work(engine: Engine) -> object:
        first = engine.generate(prompts, [SamplingParams(max_tokens=6 + 5 * i) for i in range(4)])
        follow = [p + o.token_ids + [11, 12] for p, o in zip(prompts, first)]
        second = engine.generate(follow, SamplingParams(max_tokens=9))
        return [o.token_ids for o in first], [(o.token_ids, o.num_cached_tokens) for o in second]

    (_, second), engine = run_both(make, work)
    assert all(cached > 0 for _, cached in second)
    assert engine.num_pipelined_steps > 0
