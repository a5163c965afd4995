"""EngineLoop driven directly with commands (no asyncio), on the toy model."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from toy_model import VOCAB, assert_pools_empty, expected, make_engine, padded_engine

from phloem.engine import CorruptStep, EngineError, InvalidRequest, RequestOutput, SamplingParams
from phloem.runtime.engine_commands import (
    AbortRequest,
    AddRequest,
    GetStats,
    PinPrefix,
    QueryCachedPrefix,
    UnpinPrefix,
)
from phloem.runtime.engine_loop import EngineLoop

TIMEOUT = 30.0


class Collector:
    """An output sink that records items and signals the end of the request."""

    def __init__(self) -> None:
        self.items: list[RequestOutput | EngineError] = []
        self.done = threading.Event()

    def __call__(self, item: RequestOutput | EngineError) -> None:
        self.items.append(item)
        if isinstance(item, EngineError) or item.finished:
            self.done.set()


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    engine_loop = EngineLoop(make_engine())
    engine_loop.start()
    yield engine_loop
    engine_loop.shutdown(TIMEOUT)


def test_lifecycle_errors() -> None:
    engine_loop = EngineLoop(make_engine())
    with pytest.raises(EngineError, match="got a new one"):
        engine_loop.submit(GetStats())
    engine_loop.shutdown(TIMEOUT)  # not running: a no-op
    engine_loop.start()
    with pytest.raises(RuntimeError, match="expected a new loop"):
        engine_loop.start()
    engine_loop.shutdown(TIMEOUT)
    assert not engine_loop.is_running
    with pytest.raises(EngineError, match="got a stopped one"):
        engine_loop.submit(GetStats())


def test_add_streams_to_the_sink_and_replies_with_the_id(loop: EngineLoop) -> None:
    sink = Collector()
    add = AddRequest((1, 2, 3), SamplingParams(max_tokens=7), None, sink)
    loop.submit(add)
    request_id = add.reply.result(TIMEOUT)
    assert sink.done.wait(TIMEOUT)
    outs = [o for o in sink.items if isinstance(o, RequestOutput)]
    assert len(outs) == len(sink.items) == 7
    assert {o.request_id for o in outs} == {request_id}
    assert outs[-1].token_ids == [t for o in outs for t in o.new_token_ids] == expected([1, 2, 3], 7)


def test_invalid_request_is_the_reply_and_the_sink_stays_silent(loop: EngineLoop) -> None:
    sink = Collector()
    add = AddRequest((), SamplingParams(max_tokens=3), "bad", sink)
    loop.submit(add)
    with pytest.raises(InvalidRequest, match="empty prompt"):
        add.reply.result(TIMEOUT)
    stats = GetStats()
    loop.submit(stats)
    assert stats.reply.result(TIMEOUT).num_requests == 0
    assert sink.items == []


def test_a_cancelled_command_is_skipped(loop: EngineLoop) -> None:
    sink = Collector()
    add = AddRequest((1, 2), SamplingParams(max_tokens=3), "skipped", sink)
    assert add.reply.cancel()
    loop.submit(add)
    stats = GetStats()
    loop.submit(stats)
    assert stats.reply.result(TIMEOUT).num_requests == 0 and sink.items == []


def test_abort_only_hits_the_request_of_the_given_sink(loop: EngineLoop) -> None:
    gate = threading.Event()
    sink = Collector()
    engine = loop.engine
    # Hold the engine thread inside a step so both aborts are applied between the same two steps.
    inner = engine.runner.model
    engine.runner.model = _Gated(inner, gate)
    add = AddRequest((1,), SamplingParams(max_tokens=50), "r", sink)
    loop.submit(add)
    stranger, owner = AbortRequest("r", sink=Collector()), AbortRequest("r", sink=sink)
    loop.submit(stranger)
    loop.submit(owner)
    gate.set()
    assert add.reply.result(TIMEOUT) == "r"
    assert stranger.reply.result(TIMEOUT) is False and owner.reply.result(TIMEOUT) is True
    assert sink.done.wait(TIMEOUT)
    final = sink.items[-1]
    assert isinstance(final, RequestOutput) and final.finish_reason == "abort"


def query_at_final_output(loop: EngineLoop, prompt: list[int], settled: bool) -> int:
    """Run ``prompt`` for 5 tokens; at its final output (on the engine thread, before the
    turn-end step) ask how much of the whole turn is cached; the answer."""
    answers: list[QueryCachedPrefix] = []

    def sink(item: RequestOutput | EngineError) -> None:
        if isinstance(item, RequestOutput) and item.finished:
            query = QueryCachedPrefix(tuple(prompt + item.token_ids + [0]), settled=settled)
            loop.submit(query)
            answers.append(query)

    loop.submit(AddRequest(tuple(prompt), SamplingParams(max_tokens=5), None, sink))
    for _ in range(1000):
        if answers:
            break
        threading.Event().wait(0.01)
    return answers[0].reply.result(TIMEOUT)


def test_prefix_query_after_a_final_output_sees_the_turn_end_checkpoint(loop: EngineLoop) -> None:
    prompt = list(range(1, 20))
    assert query_at_final_output(loop, prompt, settled=True) == len(prompt) + 5
    pin = PinPrefix(tuple(prompt + expected(prompt, 5)))
    loop.submit(pin)
    handle = pin.reply.result(TIMEOUT)
    assert handle is not None
    unpin = UnpinPrefix(handle)
    loop.submit(unpin)
    assert unpin.reply.result(TIMEOUT) is None


def test_an_unsettled_prefix_query_is_answered_before_the_turn_end_checkpoint(loop: EngineLoop) -> None:
    """``settled=False`` answers between the current steps: the same query, asked at the final
    output, does not yet see the turn-end checkpoint (the one before the turn's end does)."""
    prompt = list(range(21, 40))
    assert query_at_final_output(loop, prompt, settled=False) < len(prompt) + 5


def test_a_failing_sink_aborts_its_request_only() -> None:
    engine = make_engine()
    engine_loop = EngineLoop(engine)
    engine_loop.start()

    def broken(item: RequestOutput | EngineError) -> None:
        raise OSError("consumer gone")

    engine_loop.submit(AddRequest((4, 5), SamplingParams(max_tokens=30), "broken", broken))
    good = Collector()
    engine_loop.submit(AddRequest((6,), SamplingParams(max_tokens=4), "good", good))
    assert good.done.wait(TIMEOUT)
    assert good.items[-1].token_ids == expected([6], 4)  # type: ignore[union-attr]
    stats = GetStats()
    engine_loop.submit(stats)
    assert stats.reply.result(TIMEOUT).num_requests == 0
    engine_loop.shutdown(TIMEOUT)
    assert_pools_empty(engine)


class _Gated:
    def __init__(self, inner: object, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def forward(self, batch: object, caches: object) -> object:
        assert self.gate.wait(TIMEOUT), "gate never opened"
        return self.inner.forward(batch, caches)  # type: ignore[attr-defined]

    def compute_logits(self, hidden: object) -> object:
        return self.inner.compute_logits(hidden)  # type: ignore[attr-defined]


def test_requests_kept_out_by_pins_do_not_spin_the_loop() -> None:
    """Both state slots hold pinned heads: a new request waits while nothing runs. The loop then
    waits for a command between attempts (a few ms) instead of stepping flat out; once the pins
    go, the request runs."""
    engine_loop = EngineLoop(make_engine(num_slots=2))
    engine_loop.start()
    try:
        handles = []
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            sink = Collector()
            engine_loop.submit(AddRequest(tuple(prompt), SamplingParams(max_tokens=3), None, sink))
            assert sink.done.wait(TIMEOUT)
            pin = PinPrefix(tuple(prompt + expected(prompt, 3)))
            engine_loop.submit(pin)
            handles.append(pin.reply.result(TIMEOUT))
        assert all(h is not None for h in handles)
        waiting = Collector()
        engine_loop.submit(AddRequest((9, 9), SamplingParams(max_tokens=2), None, waiting))

        def steps() -> int:
            stats = GetStats()
            engine_loop.submit(stats)
            return stats.reply.result(TIMEOUT).num_steps

        before = steps()
        assert not waiting.done.wait(0.3)
        # 0.3 s at one attempt per 10 ms is ~30 steps (plus one per stats command); flat out it is thousands.
        assert steps() - before < 100
        for handle in handles:
            engine_loop.submit(UnpinPrefix(handle))
        assert waiting.done.wait(TIMEOUT)
        final = waiting.items[-1]
        assert isinstance(final, RequestOutput) and final.token_ids == expected([9, 9], 2)
    finally:
        engine_loop.shutdown(TIMEOUT)


def test_the_engine_loop_counts_the_failed_step_and_no_id_reaches_a_sink() -> None:
    """A sampled id outside the vocabulary fails the step: counted, and the request's sink gets an
    ``EngineError`` (caused by ``CorruptStep``) after only in-vocabulary tokens."""
    loop = EngineLoop(padded_engine())
    loop.start()
    items: list[RequestOutput | EngineError] = []
    done = threading.Event()

    def sink(item: RequestOutput | EngineError) -> None:
        items.append(item)
        if isinstance(item, EngineError) or item.finished:
            done.set()

    try:
        command = AddRequest((90,) * 11, SamplingParams(max_tokens=20, ignore_eos=True), None, sink)
        loop.submit(command)
        command.reply.result(10)
        assert done.wait(10)
        assert isinstance(items[-1], EngineError) and isinstance(items[-1].__cause__, CorruptStep)
        assert all(0 <= t < VOCAB for out in items[:-1] for t in out.new_token_ids)  # type: ignore[union-attr]
        stats = GetStats()
        loop.submit(stats)
        assert stats.reply.result(10).num_failed_steps == 1
    finally:
        loop.shutdown(10)
