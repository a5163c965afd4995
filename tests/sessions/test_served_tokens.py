"""Tier accounting over the real engine (tiny random-weight model): each turn's already-sent
tokens are counted once by where they came from (``sessions._served``): the GPU's prefix cache,
the host tier, the disk tier, or recompute.

Each test reads ``SessionStats.served`` before and after one turn and checks the delta adds up to
the session's history, all of it from the expected source(s).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from phloem.runtime import EngineClient
from phloem.sessions import GenerateOptions, GenerationResult, SessionInput, SessionManager

ManagerFactory = Callable[..., AbstractAsyncContextManager[SessionManager]]
OWNER = "key-1"


def unique_ids(n: int) -> tuple[int, ...]:
    """Fresh token ids, so that cache hits never come from another test."""
    rng = random.Random(uuid.uuid4().int)
    return tuple(rng.randrange(3, 1900) for _ in range(n))


async def turn(m: SessionManager, session_id: str, ids: tuple[int, ...]) -> GenerationResult:
    options = GenerateOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    return await (await m.append(OWNER, session_id, SessionInput(input_ids=ids), options)).result()


def served(m: SessionManager) -> dict[str, int]:
    return dict(m.stats().served.served_tokens)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


async def two_turns(m: SessionManager) -> tuple[str, int]:
    """A session with one generated turn; returns its id and its token count."""
    sid = (await m.create(OWNER, ttl=0)).session_id
    await turn(m, sid, unique_ids(40))
    return sid, m.get(OWNER, sid).num_tokens


def run(make_manager: ManagerFactory, body: Callable[[SessionManager], Any], **config: Any) -> Any:
    async def main() -> Any:
        async with make_manager(**config) as manager:
            return await body(manager)
    return asyncio.run(main())


def test_a_resident_session_is_served_from_the_gpu(make_manager: ManagerFactory) -> None:
    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        before = served(m)
        result = await turn(m, sid, unique_ids(5))
        d = delta(served(m), before)
        assert d == {"gpu": history, "host": 0, "disk": 0, "recomputed": 0}
        assert result.usage.cached_tokens >= history

    run(make_manager, body)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_spilled_session_is_served_from_its_tier(make_manager: ManagerFactory, engine: EngineClient,
                                                   tier: str) -> None:
    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        snap = await m.offload(OWNER, sid, tier, wait=True)  # type: ignore[arg-type]
        assert snap.status == tier
        segment_tokens = m._sessions[sid].segment.num_tokens  # type: ignore[union-attr]  # noqa: SLF001
        await engine.reset_prefix_cache()
        before, resumes_before = served(m), m.stats().served.resume_tokens[tier]
        await turn(m, sid, unique_ids(5))
        d = delta(served(m), before)
        assert d[tier] == segment_tokens > 0
        assert sum(d.values()) == history and d["gpu"] + d[tier] + d["recomputed"] == history
        assert m.stats().served.resume_tokens[tier] - resumes_before == segment_tokens
        assert m.stats().served.resume_seconds[tier].count >= 1
        # Counted once: the next turn is served by the GPU again.
        before = served(m)
        await turn(m, sid, unique_ids(5))
        assert delta(served(m), before)[tier] == 0

    run(make_manager, body)


def test_a_spilled_session_the_gpu_still_holds_is_served_from_the_gpu(make_manager: ManagerFactory) -> None:
    """Spilled to host but not evicted: the append's request carries the host copy anyway (the
    prefix is unpinned), the engine finds the prefix cached and does not load it, and the turn
    counts the GPU, not a resume."""
    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        assert (await m.offload(OWNER, sid, "host", wait=True)).status == "host"
        before, resumes_before = served(m), m.stats().served.resume_tokens["host"]
        await turn(m, sid, unique_ids(5))
        assert delta(served(m), before) == {"gpu": history, "host": 0, "disk": 0, "recomputed": 0}
        assert m.stats().served.resume_tokens["host"] == resumes_before

    run(make_manager, body)


def test_a_spilled_prefix_evicted_before_admission_is_resumed_from_host(
        make_manager: ManagerFactory, engine: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU still held the spilled prefix when the append began, and lost it before the
    engine admitted the request (other requests' admissions evict unpinned prefixes): the host
    copy the request carried is loaded, nothing is recomputed."""
    real_generate = engine.generate

    async def evicting_generate(*args: Any, **kwargs: Any) -> Any:
        await engine.reset_prefix_cache()
        async for out in real_generate(*args, **kwargs):
            yield out

    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        assert (await m.offload(OWNER, sid, "host", wait=True)).status == "host"
        segment_tokens = m._sessions[sid].segment.num_tokens  # type: ignore[union-attr]  # noqa: SLF001
        monkeypatch.setattr(engine, "generate", evicting_generate)
        before = served(m)
        result = await turn(m, sid, unique_ids(5))
        d = delta(served(m), before)
        assert d["host"] == segment_tokens > 0 and d["recomputed"] == history - segment_tokens
        assert result.usage.cached_tokens >= segment_tokens

    run(make_manager, body)


def test_a_prefetched_session_counts_its_tier_on_the_next_turn(make_manager: ManagerFactory,
                                                               engine: EngineClient) -> None:
    async def body(m: SessionManager) -> None:
        sid, _ = await two_turns(m)
        await m.offload(OWNER, sid, "host", wait=True)
        await engine.reset_prefix_cache()
        await m.prefetch(OWNER, sid, wait=True)
        before = served(m)
        await turn(m, sid, unique_ids(5))
        assert delta(served(m), before)["host"] > 0

    run(make_manager, body)


@pytest.mark.parametrize("tiers", [True, False])
def test_an_evicted_session_without_a_segment_is_recomputed(make_manager: ManagerFactory,
                                                            engine: EngineClient, tiers: bool) -> None:
    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        if not tiers:
            await m.offload(OWNER, sid, "host", wait=True)
            assert m.get(OWNER, sid).status == "idle", "with the tiers off nothing spills"
        await engine.reset_prefix_cache()
        before = served(m)
        await turn(m, sid, unique_ids(5))
        assert delta(served(m), before) == {"gpu": 0, "host": 0, "disk": 0, "recomputed": history}

    run(make_manager, body, session_tiers=tiers)


def test_tokens_appended_without_generation_are_new_not_history(make_manager: ManagerFactory) -> None:
    async def body(m: SessionManager) -> None:
        sid, history = await two_turns(m)
        before = served(m)
        await (await m.append(OWNER, sid, SessionInput(input_ids=unique_ids(3)), None)).result()
        assert served(m) == before
        await turn(m, sid, unique_ids(2))
        assert delta(served(m), before) == {"gpu": history, "host": 0, "disk": 0, "recomputed": 0}

    run(make_manager, body)
