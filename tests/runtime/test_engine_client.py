"""EngineClient over the engine loop thread, driven by the toy model (closed-form answers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch
from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import CapacityExceeded, Engine, EngineError, InvalidRequest, SamplingParams
from phloem.runtime import EngineClient

T = TypeVar("T")

PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 40)), [7] * 4, [9, 8], list(range(50, 63)), [11] * 17, [5, 6, 7]]


def run(main: Callable[[EngineClient], Awaitable[T]], engine: Engine) -> T:
    """Run ``main(client)`` on a fresh event loop with a started client; always shut it down."""

    async def wrapper() -> T:
        client = EngineClient(engine)
        client.start()
        try:
            return await main(client)
        finally:
            await client.shutdown()

    return asyncio.run(wrapper())


class SlowModel:
    """Wraps the toy model: each forward sleeps, so a long request is still running when we act."""

    def __init__(self, inner: Any, delay_s: float = 0.005) -> None:
        self.inner, self.delay_s = inner, delay_s

    def forward(self, batch: Any, caches: Any) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.inner.forward(batch, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


class FlakyModel(SlowModel):
    """Raises once, on the first forward whose batch holds ``fail_at_num_seqs`` sequences."""

    def __init__(self, inner: Any, fail_at_num_seqs: int) -> None:
        super().__init__(inner, delay_s=0.001)
        self.fail_at_num_seqs, self.num_failures = fail_at_num_seqs, 0

    def forward(self, batch: Any, caches: Any) -> torch.Tensor:
        if batch.num_seqs == self.fail_at_num_seqs and not self.num_failures:
            self.num_failures += 1
            raise RuntimeError("injected failure")
        return super().forward(batch, caches)


def test_stream_deltas_concatenate_to_final_tokens() -> None:
    async def main(client: EngineClient) -> None:
        outs = [o async for o in client.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=12))]
        final = outs[-1]
        assert final.finished and final.finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids == expected([1, 2, 3, 4, 5], 12)

    run(main, make_engine())


def test_concurrent_generations_equal_engine_generate() -> None:
    params = SamplingParams(max_tokens=12)
    reference = make_engine().generate(PROMPTS, params)

    async def collect(client: EngineClient, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(prompt, params):
            tokens += out.new_token_ids
        return tokens

    async def main(client: EngineClient) -> list[list[int]]:
        return list(await asyncio.gather(*(collect(client, p) for p in PROMPTS)))

    results = run(main, make_engine())
    assert results == [r.token_ids for r in reference]


@pytest.mark.parametrize("how", ["aclose", "cancel", "break", "raise"])
@pytest.mark.parametrize("caching", [False, True], ids=["no-cache", "cache"])
def test_consumer_leaving_mid_stream_aborts_and_frees_memory(how: str, caching: bool) -> None:
    engine = make_engine(caching=caching)
    engine.runner.model = SlowModel(engine.runner.model)
    params = SamplingParams(max_tokens=400)

    async def consume(client: EngineClient, seen: asyncio.Event) -> None:
        async for _ in client.generate([1, 2, 3, 4, 5], params, request_id="long"):
            seen.set()
            if how == "raise":
                raise KeyError("consumer failed")
            if how == "break":
                break

    async def main(client: EngineClient) -> None:
        if how == "aclose":
            stream = client.generate([1, 2, 3, 4, 5], params, request_id="long")
            await stream.__anext__()
            await stream.aclose()
        else:
            seen = asyncio.Event()
            task = asyncio.create_task(consume(client, seen))
            await seen.wait()
            if how == "cancel":
                task.cancel()
            (outcome,) = await asyncio.gather(task, return_exceptions=True)
            raised = {"cancel": asyncio.CancelledError, "raise": KeyError, "break": type(None)}[how]
            assert isinstance(outcome, raised)
        # A request leaves the loop's books only when the engine has aborted (and released) it.
        for _ in range(200):
            stats = await client.stats()
            if stats.num_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.num_requests == 0
        if not caching:
            assert (stats.num_free_pages, stats.num_free_slots) == (stats.num_pages, stats.num_slots)
        assert await client.abort("long") is False

    run(main, engine)
    # Far fewer than 400 decode steps ran: the request was aborted, not run to completion.
    assert engine.runner.model.inner.num_forwards < 100
    # With the cache, what the aborted request published is the tree's; emptied, all is free.
    assert_pools_empty(engine)


@pytest.mark.parametrize(
    ("prompt", "error"),
    [([], InvalidRequest), ([1, 97], InvalidRequest), ([1] * 600, InvalidRequest), ([1] * 300, CapacityExceeded)],
    ids=["empty", "out-of-vocab", "too-long", "over-capacity"],
)
def test_invalid_input_raises_and_loop_keeps_serving(prompt: list[int], error: type[Exception]) -> None:
    async def main(client: EngineClient) -> None:
        stream = client.generate(prompt, SamplingParams(max_tokens=4))
        with pytest.raises(error):
            await stream.__anext__()
        outs = [o async for o in client.generate([2, 3], SamplingParams(max_tokens=5))]
        assert outs[-1].token_ids == expected([2, 3], 5)
        assert (await client.stats()).num_requests == 0

    # 64 pages of 4 tokens hold 256 tokens: 300 is valid for the model (512) but over capacity.
    run(main, make_engine())


def test_duplicate_request_id_fails_without_touching_the_first() -> None:
    async def main(client: EngineClient) -> None:
        first = client.generate([1, 2, 3], SamplingParams(max_tokens=30), request_id="same")
        head = await first.__anext__()
        second = client.generate([4, 5], SamplingParams(max_tokens=3), request_id="same")
        with pytest.raises(InvalidRequest, match="already in flight"):
            await second.__anext__()
        rest = [o async for o in first]
        assert rest[-1].finish_reason == "length"
        assert head.new_token_ids + [t for o in rest for t in o.new_token_ids] == expected([1, 2, 3], 30)

    engine = make_engine()
    engine.runner.model = SlowModel(engine.runner.model)
    run(main, engine)


def test_step_exception_fails_in_flight_requests_and_next_request_succeeds() -> None:
    engine = make_engine()
    # The failure hits the first step that batches all three requests below (50 tokens each).
    engine.runner.model = FlakyModel(engine.runner.model, fail_at_num_seqs=3)

    async def doomed(client: EngineClient, prompt: list[int]) -> BaseException:
        with pytest.raises(EngineError, match="injected failure") as info:
            async for _ in client.generate(prompt, SamplingParams(max_tokens=50)):
                pass
        return info.value

    async def main(client: EngineClient) -> None:
        errors = await asyncio.gather(*(doomed(client, p) for p in ([1, 2], [3], [4, 5, 6])))
        assert all(isinstance(e.__cause__, RuntimeError) for e in errors)
        stats = await client.stats()
        assert stats.num_failed_steps == 1 and stats.num_requests == 0, stats
        outs = [o async for o in client.generate([7, 8], SamplingParams(max_tokens=6))]
        assert outs[-1].token_ids == expected([7, 8], 6)

    run(main, engine)
    assert engine.runner.model.num_failures == 1
    assert_pools_empty(engine)


def test_abort_from_another_task_ends_the_stream_with_abort() -> None:
    engine = make_engine()
    engine.runner.model = SlowModel(engine.runner.model)

    async def main(client: EngineClient) -> None:
        stream = client.generate([1, 2], SamplingParams(max_tokens=400), request_id="r1")
        first = await stream.__anext__()
        assert await client.abort("r1") is True
        rest = [o async for o in stream]
        final = rest[-1]
        assert final.finished and final.finish_reason == "abort" and final.new_token_ids == []
        streamed = first.new_token_ids + [t for o in rest for t in o.new_token_ids]
        assert final.token_ids == streamed == expected([1, 2], len(streamed))
        assert await client.abort("r1") is False
        assert await client.abort("never-seen") is False

    run(main, engine)
    assert_pools_empty(engine)


def test_prefix_queries_pin_and_unpin() -> None:
    async def main(client: EngineClient) -> None:
        prompt = list(range(1, 30))
        out = [o async for o in client.generate(prompt, SamplingParams(max_tokens=4))][-1]
        history = prompt + out.token_ids
        assert await client.cached_prefix_len(history + [1]) > 0
        assert await client.cached_prefix_len([96, 95, 94]) == 0
        handle = await client.pin_prefix(history)
        assert handle is not None
        await client.unpin_prefix(handle)
        assert await client.pin_prefix([96, 95, 94]) is None

    run(main, make_engine())


def test_export_reset_import_resumes_from_the_checkpoint() -> None:
    engine = make_engine()

    async def main(client: EngineClient) -> None:
        prompt = list(range(1, 30))
        out = [o async for o in client.generate(prompt, SamplingParams(max_tokens=4))][-1]
        history = prompt + out.token_ids
        # Asked right after the final output: the turn-end checkpoint is waited for.
        state = await client.export_prefix(history)
        assert state is not None and list(state.token_ids) == history
        assert await client.export_prefix([96, 95, 94]) is None
        await client.reset_prefix_cache()
        assert await client.cached_prefix_len(history + [1]) == 0
        assert await client.import_prefix(state)
        assert await client.cached_prefix_len(history + [1]) == len(history)
        nxt = [o async for o in client.generate(history + [5], SamplingParams(max_tokens=3))][-1]
        assert nxt.num_cached_tokens == len(history)
        assert nxt.token_ids == expected(history + [5], 3)

    run(main, engine)
    assert_pools_empty(engine)


def test_shutdown_fails_in_flight_and_later_calls() -> None:
    engine = make_engine()
    engine.runner.model = SlowModel(engine.runner.model)

    async def main() -> None:
        client = EngineClient(engine)
        assert client.model_config.vocab_size == 97 and client.max_model_len == 512
        with pytest.raises(EngineError, match="running"):
            await client.stats()
        async with client:
            stream = client.generate([1], SamplingParams(max_tokens=400))
            await stream.__anext__()
            shutdown = asyncio.create_task(client.shutdown())
            with pytest.raises(EngineError, match="shut down"):
                async for _ in stream:
                    pass
            await shutdown
            assert not client.is_running
            with pytest.raises(EngineError):
                await client.generate([1], SamplingParams(max_tokens=1)).__anext__()

    asyncio.run(main())
    assert_pools_empty(engine)


def test_stats_count_the_preemptions() -> None:
    """Six requests that outgrow 12 pages: running ones are preempted for the pages their peers'
    decodes need, and the loop's stats (``/metrics``' ``phloem_engine_preemptions_total``) count
    each one; every request still gets its tokens."""
    prompts = [[i + 1] * 6 for i in range(6)]
    engine = make_engine(num_pages=12, num_slots=8, budget=64)

    async def main(client: EngineClient) -> int:
        async def one(prompt: list[int]) -> list[int]:
            return [o async for o in client.generate(prompt, SamplingParams(max_tokens=12))][-1].token_ids

        tokens = await asyncio.gather(*(one(p) for p in prompts))
        assert tokens == [expected(p, 12) for p in prompts]
        return (await client.stats()).num_preemptions

    assert run(main, engine) == engine.scheduler.num_preemptions > 0
    assert_pools_empty(engine)
