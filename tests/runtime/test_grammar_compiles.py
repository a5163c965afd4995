"""The grammar compile pool: its own threads, at most ``compile_per_owner`` compiles per owner
(the rest queued), one compile for identical grammars in flight, queued compiles dropped when
nobody waits for them any more, and the per-request time budget."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from phloem.engine import GrammarConfig, GrammarSpec, InvalidRequest
from phloem.engine.sampling.grammar import GrammarStats
from phloem.runtime.grammar_compiles import GrammarCompiles


class FakeBackend:
    """Compiles block until released; records what started, on which thread."""

    def __init__(self, config: GrammarConfig) -> None:
        self.config = config
        self.started: list[tuple[str, str | None]] = []
        self.threads: set[str] = set()
        self.release: dict[str, threading.Event] = {}
        self.kept: dict[GrammarSpec, str] = {}

    def gate(self, name: str) -> threading.Event:
        return self.release.setdefault(name, threading.Event())

    def check(self, spec: GrammarSpec) -> Any:
        if spec.source == '"too big"':
            raise InvalidRequest("grammar: too big")
        return None

    def cached(self, spec: GrammarSpec) -> Any:
        return self.kept.get(spec)

    def compile(self, spec: GrammarSpec, owner: str | None = None) -> Any:
        name = spec.source.strip('"')
        self.started.append((name, owner))
        self.threads.add(threading.current_thread().name)
        assert self.gate(name).wait(10)
        if name.startswith("bad"):
            raise InvalidRequest(f"grammar: {name} cannot be compiled")
        self.kept[spec] = f"compiled {name}"
        return f"compiled {name}"

    def stats(self) -> GrammarStats:
        return GrammarStats(0, len(self.kept), 1, 0, len(self.started), 0)


def spec(name: str) -> GrammarSpec:
    return GrammarSpec("json_schema", f'"{name}"')


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.02)


def test_an_owner_runs_one_compile_at_a_time_and_others_still_get_a_thread() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig(compile_workers=2, compile_per_owner=1))
        pool = GrammarCompiles(backend)
        a = [asyncio.ensure_future(pool.compile(spec(f"a{i}"), "A")) for i in range(3)]
        await settle()
        assert backend.started == [("a0", "A")] and pool.running("A") == 1 and pool.queued("A") == 2
        b = asyncio.ensure_future(pool.compile(spec("b0"), "B"))
        await settle()
        assert backend.started[-1] == ("b0", "B"), "B compiles on the worker A cannot take"
        backend.gate("b0").set()
        assert await asyncio.wait_for(b, 5) == "compiled b0"
        for i in range(3):
            backend.gate(f"a{i}").set()
        assert await asyncio.gather(*a) == ["compiled a0", "compiled a1", "compiled a2"]
        assert [n for n, _ in backend.started] == ["a0", "b0", "a1", "a2"]
        assert backend.threads <= {"phloem-grammar_0", "phloem-grammar_1"}
        assert pool.running("A") == pool.queued("A") == 0
        pool.close()
    asyncio.run(main())


def test_identical_grammars_share_one_compile_and_the_cache_answers_after() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig())
        pool = GrammarCompiles(backend)
        waits = [asyncio.ensure_future(pool.compile(spec("s"), owner)) for owner in ("A", "B", "A")]
        await settle()
        backend.gate("s").set()
        assert await asyncio.gather(*waits) == ["compiled s"] * 3
        assert await pool.compile(spec("s"), "C") == "compiled s"
        assert backend.started == [("s", "A")]
        pool.close()
    asyncio.run(main())


def test_a_queued_compile_nobody_waits_for_never_starts() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig(compile_per_owner=1))
        pool = GrammarCompiles(backend)
        first = asyncio.ensure_future(pool.compile(spec("a0"), "A"))
        queued = [asyncio.ensure_future(pool.compile(spec(f"a{i}"), "A")) for i in (1, 2)]
        await settle()
        for task in (*queued, first):
            task.cancel()  # the clients hung up
        await settle()
        # a1 and a2 are dropped; a0 runs on (it started) and keeps A's slot.
        assert pool.queued("A") == 0 and pool.running("A") == 1 and pool.stats(backend.stats()).abandoned == 2
        later = asyncio.ensure_future(pool.compile(spec("a3"), "A"))
        await settle()
        assert pool.queued("A") == 1, "hanging up freed no slot"
        backend.gate("a0").set()
        backend.gate("a3").set()
        assert await asyncio.wait_for(later, 5) == "compiled a3"
        assert [n for n, _ in backend.started] == ["a0", "a3"], "a1 and a2 never started"
        assert spec("a0") in backend.kept, "a started compile is kept for a retry"
        pool.close()
    asyncio.run(main())


def test_the_time_budget_refuses_the_request_but_keeps_the_owners_slot() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig(compile_per_owner=1, compile_timeout_s=0.2))
        pool = GrammarCompiles(backend)
        with pytest.raises(InvalidRequest, match=r"not compiled within the 0.2 s budget \(compile_timeout_s\)"):
            await pool.compile(spec("slow"), "A")
        assert pool.running("A") == 1, "still compiling: A cannot start another meanwhile"
        later = asyncio.ensure_future(pool.compile(spec("next"), "A"))
        await settle()
        assert pool.queued("A") == 1
        backend.gate("slow").set()
        backend.gate("next").set()
        assert await asyncio.wait_for(later, 5) == "compiled next"
        assert pool.stats(backend.stats()).timeouts == 1
        pool.close()
    asyncio.run(main())


def test_limits_and_compile_errors_reach_the_request() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig())
        pool = GrammarCompiles(backend)
        with pytest.raises(InvalidRequest, match="too big"):
            await pool.compile(GrammarSpec("json_schema", '"too big"'), "A")
        assert backend.started == [], "refused before it reached the pool"
        backend.gate("bad").set()
        with pytest.raises(InvalidRequest, match="bad cannot be compiled"):
            await pool.compile(spec("bad"), "A")
        assert pool.running("A") == 0
        pool.close()
    asyncio.run(main())


def test_a_request_aborted_while_its_grammar_waits_never_reaches_the_engine() -> None:
    from toy_model import assert_pools_empty, make_engine

    from phloem.engine import SamplingParams
    from phloem.runtime import EngineClient

    engine = make_engine()
    backend = FakeBackend(GrammarConfig(compile_per_owner=1))
    engine.grammar = backend  # type: ignore[assignment]

    async def consume(stream: Any) -> list[Any]:
        return [out async for out in stream]

    async def main() -> None:
        client = EngineClient(engine)
        client.start()
        try:
            def generate(name: str) -> Any:
                params = SamplingParams(max_tokens=4, grammar=spec(name))
                return asyncio.ensure_future(consume(client.generate([3], params, name, namespace="A")))

            first, second, third = generate("g1"), generate("g2"), generate("g3")
            await settle()
            pool = client._compiles
            assert pool is not None and pool.running("A") == 1 and pool.queued("A") == 2
            assert await client.abort("g2") is True  # queued: dropped
            [out] = await asyncio.wait_for(second, 5)
            assert out.finished and out.finish_reason == "abort" and out.token_ids == []
            third.cancel()  # the client went away
            await settle()
            assert pool.queued("A") == 0 and pool.stats(backend.stats()).abandoned == 2
            assert await client.abort("g1") is True  # started: the request ends, the compile runs on
            assert (await asyncio.wait_for(first, 5))[0].finish_reason == "abort"
            backend.gate("g1").set()
            await settle()
            assert [n for n, _ in backend.started] == ["g1"] and pool.running("A") == 0
            assert (await client.stats()).num_requests == 0
        finally:
            await client.shutdown()

    asyncio.run(main())
    assert_pools_empty(engine)


def test_a_shared_grammar_queued_behind_one_owner_is_taken_over_by_a_free_one() -> None:
    async def main() -> None:
        backend = FakeBackend(GrammarConfig(compile_workers=2, compile_per_owner=1))
        pool = GrammarCompiles(backend)
        busy = asyncio.ensure_future(pool.compile(spec("a0"), "A"))
        shared_a = asyncio.ensure_future(pool.compile(spec("s"), "A"))  # queued behind a0
        await settle()
        shared_b = asyncio.ensure_future(pool.compile(spec("s"), "B"))
        await settle()
        assert backend.started == [("a0", "A"), ("s", "B")] and pool.queued("A") == 0
        backend.gate("s").set()
        assert await asyncio.gather(shared_a, shared_b) == ["compiled s"] * 2
        backend.gate("a0").set()
        assert await busy == "compiled a0"
        pool.close()
    asyncio.run(main())
