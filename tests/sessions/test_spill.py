"""Tiered session state over the real engine (tiny random-weight model): spill to host and disk,
resume copy-on-write, forks of spilled sessions, restarts, faults, and pins that never deadlock.

Every resume path is checked against a never-spilled twin (same tokens, greedy, same output
token for token), and ``cached_tokens`` shows the resume reused the spilled prefix. The
engine's prefix cache is reset before the compared turns, so a hit can only come from the
spilled segment. Each test runs on both index backends (``index_config``) unless it is about
one of them.
"""

from __future__ import annotations

import asyncio
import gc
import random
import resource
import shutil
import signal
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from redis_support import TcpProxy, clear_prefix, random_prefix, require_redis

from phloem.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from phloem.runtime import EngineClient
from phloem.sessions import (
    GenerateOptions, GenerationResult, Overloaded, SessionConfig, SessionInput, SessionManager, Tokenizer,
    model_fingerprint,
)
from phloem.storage import DiskStore, RedisIndex, Segment, SessionRecord, SQLiteIndex

T = TypeVar("T")
ManagerFactory = Callable[..., AbstractAsyncContextManager[SessionManager]]
OWNER = "key-1"


def greedy(max_tokens: int = 4) -> GenerateOptions:
    return GenerateOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def unique_ids(n: int) -> tuple[int, ...]:
    """Fresh token ids, so that cache hits never come from another test."""
    rng = random.Random(uuid.uuid4().int)
    return tuple(rng.randrange(3, 1900) for _ in range(n))


async def turn(m: SessionManager, session_id: str, ids: tuple[int, ...],
               max_tokens: int = 4) -> GenerationResult:
    generation = await m.append(OWNER, session_id, SessionInput(input_ids=ids), greedy(max_tokens))
    return await generation.result()


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for a condition"
        await asyncio.sleep(0.02)


def run(make_manager: ManagerFactory, body: Callable[[SessionManager], Awaitable[T]],
        **config: Any) -> T:
    async def main() -> T:
        async with make_manager(**config) as manager:
            return await body(manager)
    return asyncio.run(main())


async def segment_bytes(engine: EngineClient) -> int:
    """The host tier's cost of a 47-token session (a 40-token prompt and a 3-token turn of 4
    generated), measured on a throwaway prefix."""
    from phloem.engine import SamplingParams

    probe = list(unique_ids(43))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = [o async for o in engine.generate(probe, params)][-1]
    state = await engine.export_prefix(probe + out.token_ids)
    assert state is not None and state.num_tokens == 47
    return state.nbytes + 8 * state.num_tokens  # with its token ids (int64)


def index_record(m: SessionManager, session_id: str) -> SessionRecord | None:
    return m._store._index.get_session(session_id)  # noqa: SLF001 (what the index says)


async def twin_and_resumed(engine: EngineClient, m: SessionManager, twin_id: str, spilled_id: str,
                           follow: tuple[int, ...]) -> tuple[GenerationResult, GenerationResult]:
    """The same turn on a never-spilled twin (from scratch) and on the spilled session, each
    after a cache reset: only the spilled segment can make the second a hit."""
    await engine.reset_prefix_cache()
    twin = await turn(m, twin_id, follow)
    assert twin.usage.cached_tokens == 0
    await engine.reset_prefix_cache()
    return twin, await turn(m, spilled_id, follow)


def test_a_resumed_turn_is_freed_without_the_cyclic_gc(make_manager: ManagerFactory, engine: EngineClient) -> None:
    """A turn's ``Generation``, and the spilled state it resumed from, are gone once the turn is
    over by reference counting alone. A reference cycle through them (the generation's hooks
    closing over it) kept every resumed session's whole history in host memory until a full
    collection (docs/benchmarks.md, "Server host memory over a fleet run")."""
    async def body(m: SessionManager) -> None:
        sid = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(40)), ttl=0)).session_id
        await turn(m, sid, unique_ids(3))
        await m.offload(OWNER, sid, "disk", wait=True)
        await engine.reset_prefix_cache()  # only the segment read back can serve the history
        loaded: list[weakref.ref[Any]] = []
        read = m._spill.state_for_append  # noqa: SLF001

        async def recording(session: Any) -> Any:
            state = await read(session)
            if state is not None:
                loaded.append(weakref.ref(state.kv))
            return state

        m._spill.state_for_append = recording  # type: ignore[method-assign]  # noqa: SLF001
        gc.disable()
        try:
            generation = await m.append(OWNER, sid, SessionInput(input_ids=unique_ids(5)), greedy())
            result = await generation.result()
            assert result.usage.cached_tokens == 47 and len(loaded) == 1, "the turn resumed from disk"
            gone = weakref.ref(generation)
            del generation
            await asyncio.sleep(0.05)  # the generation's task finishes its bookkeeping
            assert gone() is None, gc.get_referrers(gone())
            assert loaded[0]() is None, "the resumed state outlived its turn"
        finally:
            gc.enable()

    run(make_manager, body)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_resume_equals_a_never_spilled_twin(make_manager: ManagerFactory, engine: EngineClient,
                                            index_config: dict[str, Any], tier: str) -> None:
    async def body(m: SessionManager) -> None:
        prompt, first, second = unique_ids(40), unique_ids(3), unique_ids(5)
        a = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        b = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        assert (await turn(m, a, first)).output_ids == (await turn(m, b, first)).output_ids

        snap = await m.offload(OWNER, a, tier, wait=True)  # type: ignore[arg-type]
        assert snap.status == tier and m.get(OWNER, b).status == "idle"
        segment = m._sessions[a].segment  # noqa: SLF001
        assert segment is not None and segment.num_tokens == snap.num_tokens
        record = index_record(m, a)
        assert record is not None and (record.tier, record.segment_id) == (tier, segment.segment_id)
        on_disk = m._store.disk.exists(a, segment.segment_id)  # noqa: SLF001
        assert on_disk == (tier == "disk") and (segment.segment_id in m._spill.host) != on_disk  # noqa: SLF001

        twin, resumed = await twin_and_resumed(engine, m, b, a, second)
        assert resumed.usage.cached_tokens == snap.num_tokens, "the spilled prefix was reused"
        assert resumed.output_ids == twin.output_ids
        assert m.get(OWNER, a).status == "idle" and index_record(m, a).tier == "gpu"  # type: ignore[union-attr]
        assert [t.end for t in m.turns(OWNER, a)] == [t.end for t in m.turns(OWNER, b)]

    run(make_manager, body, **index_config)


def test_sweeper_spills_idle_sessions_and_demotes_the_oldest_to_disk(
        make_manager: ManagerFactory, engine: EngineClient, index_config: dict[str, Any]) -> None:
    async def main() -> None:
        budget = int(1.5 * await segment_bytes(engine))  # holds one segment
        async with make_manager(**index_config, host_budget_bytes=budget, idle_to_host_s=0.0,
                                sweep_interval_s=0.05) as m:
            ids = []
            for _ in range(2):
                s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(40)), ttl=0)
                await turn(m, s.session_id, unique_ids(3))
                ids.append(s.session_id)
                await wait_for(lambda sid=s.session_id: m.get(OWNER, sid).status == "host")
            a, b = ids
            await wait_for(lambda: m.get(OWNER, a).status == "disk")
            assert m.get(OWNER, b).status == "host" and m._spill.host.used_bytes <= budget  # noqa: SLF001
            # A spill takes its status before its index write lands (``Spiller._let_go``).
            await wait_for(lambda: all(index_record(m, sid).tier != "gpu" for sid in ids))  # type: ignore[union-attr]
            assert [index_record(m, sid).tier for sid in ids] == ["disk", "host"]  # type: ignore[union-attr]
            await engine.reset_prefix_cache()
            for sid in ids:
                result = await turn(m, sid, unique_ids(2))
                assert result.usage.cached_tokens == 47, f"{sid} resumed from its segment"

    asyncio.run(main())


class HeldWrites:
    """The disk store's writes held until ``release`` (up to 10 s: a disk slower than the
    spills), counting those running and done."""

    def __init__(self, disk: DiskStore) -> None:
        self._write, self._lock = disk.write, threading.Lock()
        self.running = self.done = 0
        self._go = threading.Event()
        disk.write = self  # type: ignore[method-assign]

    def release(self) -> None:
        self._go.set()

    def __call__(self, segment: Segment) -> Path:
        with self._lock:
            self.running += 1
        try:
            self._go.wait(timeout=10.0)
            return self._write(segment)
        finally:
            with self._lock:
                self.running -= 1
                self.done += 1


async def spilled_sessions(m: SessionManager, prompts: list[tuple[int, ...]], first: tuple[int, ...],
                           to_host: int, twin: bool = False) -> list[str]:
    """A pinned session per prompt, each with the turn ``first``; the first ``to_host`` spilled
    to host. With ``twin``, one more, unpinned (a cache reset forgets it), with the last prompt."""
    ids = []
    for i, prompt in enumerate([*prompts, prompts[-1]] if twin else prompts):
        ttl = 0.0 if twin and i == len(prompts) else 3600.0
        s = await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=ttl)
        await turn(m, s.session_id, first)
        ids.append(s.session_id)
    for sid in ids[:to_host]:
        await m.offload(OWNER, sid, "host", wait=True)
    return ids


def test_spills_into_a_full_host_tier_do_not_wait_for_the_disk(
        make_manager: ManagerFactory, engine: EngineClient) -> None:
    """Two sessions spilled at once into a full host tier leave the GPU's pins at once, while
    the disk writes that make their room are still held: their copies wait in the backlog
    (``sessions.tiers._segments``), readable. A spill that waited for its demotion held its
    session's pages on the GPU for a disk write (docs/benchmarks.md, the 128-agent H100 fleet).
    The backlog's two writers demote two different segments side by side: the segment being
    demoted is read with ``HostPool.get``, which makes it the most recently used, so the other
    writer's ``oldest`` is another one. Every session then resumes from its segment."""
    async def main() -> None:
        size = await segment_bytes(engine)
        async with make_manager(host_budget_bytes=int(2.5 * size), host_backlog_bytes=2 * size,
                                idle_to_host_s=3600.0) as m:
            ids = await spilled_sessions(m, [unique_ids(40) for _ in range(4)], unique_ids(3), to_host=2)
            writes = HeldWrites(m._spill._tiers.disk)  # noqa: SLF001
            await asyncio.gather(*(m.offload(OWNER, sid, "host", wait=True) for sid in ids[2:]))
            assert [m.get(OWNER, sid).status for sid in ids] == ["host"] * 4
            assert writes.done == 0 and m._spill.backlog_bytes == 2 * size  # noqa: SLF001
            assert all(m._sessions[sid].pin is None for sid in ids), "unpinned before the disk wrote"  # noqa: SLF001
            await wait_for(lambda: writes.running == 2)  # fails when the demotions run one at a time
            writes.release()
            # A demotion marks its holders ``disk`` before its writer moves the backlog segment it
            # made room for into the pool (the holders' index update is awaited between the two).
            await wait_for(lambda: [m.get(OWNER, sid).status for sid in ids] == ["disk", "disk", "host", "host"]
                           and m._spill.backlog_bytes == 0)  # noqa: SLF001
            assert m._spill.host.used_bytes <= int(2.5 * size) and m._spill.backlog_bytes == 0  # noqa: SLF001
            await engine.reset_prefix_cache()
            for sid in ids:
                assert (await turn(m, sid, unique_ids(2))).usage.cached_tokens == 47, sid

    asyncio.run(main())


def test_a_turn_resumes_from_the_backlog_while_the_disk_writes(
        make_manager: ManagerFactory, engine: EngineClient) -> None:
    """The agent returns while its spilled copy still waits in the backlog for room (the disk
    write that makes it held): its turn loads that copy, token for token what its never-spilled
    twin says; once the disk writes, the copy moves into the host pool."""
    async def main() -> None:
        size = await segment_bytes(engine)
        async with make_manager(host_budget_bytes=int(1.5 * size), idle_to_host_s=3600.0) as m:
            prompt, first = unique_ids(40), unique_ids(3)
            filler, a, twin = await spilled_sessions(m, [unique_ids(40), prompt], first, to_host=1, twin=True)
            writes = HeldWrites(m._spill._tiers.disk)  # noqa: SLF001
            await m.offload(OWNER, a, "host", wait=True)
            assert m.get(OWNER, a).status == "host" and m._spill.backlog_bytes == size  # noqa: SLF001
            expected, resumed = await twin_and_resumed(engine, m, twin, a, unique_ids(2))
            assert resumed.usage.cached_tokens == 47 and resumed.output_ids == expected.output_ids
            assert writes.done == 0, "resumed while the disk write was still held"
            writes.release()
            await wait_for(lambda: m._spill.backlog_bytes == 0)  # noqa: SLF001
            assert m.get(OWNER, filler).status == "disk" and m._spill.host.used_bytes == size  # noqa: SLF001

    asyncio.run(main())


def test_a_disk_a_whole_backlog_behind_drops_the_oldest_host_segment(
        make_manager: ManagerFactory, engine: EngineClient) -> None:
    """With the backlog full and its demotion still writing, the next spill drops the host
    pool's least recently used segment that no writer holds instead of waiting: that session
    recomputes its history (same tokens as its twin), counted as dropped; nothing else moves."""
    async def main() -> None:
        size = await segment_bytes(engine)
        async with make_manager(host_budget_bytes=int(2.5 * size), host_backlog_bytes=1,
                                idle_to_host_s=3600.0) as m:
            prompt, first = unique_ids(40), unique_ids(3)
            x, b, c, d, twin = await spilled_sessions(
                m, [unique_ids(40), unique_ids(40), unique_ids(40), prompt], first, to_host=0, twin=True)
            for sid in (x, d):
                await m.offload(OWNER, sid, "host", wait=True)
            writes = HeldWrites(m._spill._tiers.disk)  # noqa: SLF001
            await m.offload(OWNER, b, "host", wait=True)  # the backlog (one segment) is full
            await wait_for(lambda: writes.running == 1)  # x is being demoted to make b's room
            await m.offload(OWNER, c, "host", wait=True)
            assert [m.get(OWNER, sid).status for sid in (x, d, b, c)] == ["host", "disk", "host", "host"]
            assert m._sessions[d].segment is None  # noqa: SLF001
            assert m.stats().segments_dropped.count == 1 and m.stats().segments_dropped.nbytes == size
            writes.release()
            await wait_for(lambda: m._spill.backlog_bytes == 0)  # noqa: SLF001
            assert [m.get(OWNER, sid).status for sid in (x, d, b, c)] == ["disk", "disk", "host", "host"]
            expected, recomputed = await twin_and_resumed(engine, m, twin, d, unique_ids(2))
            assert recomputed.usage.cached_tokens == 0 and recomputed.output_ids == expected.output_ids
            for sid in (x, b, c):
                assert (await turn(m, sid, unique_ids(2))).usage.cached_tokens == 47, sid

    asyncio.run(main())


@pytest.mark.parametrize("ttl", [0.0, 0.3])
def test_with_no_idle_delay_a_session_is_spilled_before_its_pin_ends(
        make_manager: ManagerFactory, engine: EngineClient, ttl: float) -> None:
    """``idle_to_host_s == 0``: when the pin ends (right after the turn, or at the TTL) the state
    goes to host first, so it is never evictable without a copy; the sweeper (an hour away here)
    plays no part. After the cache is emptied the next turn resumes from the segment."""
    async def body(m: SessionManager) -> None:
        s = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(40)), ttl=ttl)).session_id
        await turn(m, s, unique_ids(3))
        await wait_for(lambda: m.get(OWNER, s).status != "active", timeout_s=5.0)
        assert m.get(OWNER, s).status == "host"
        segment = m._sessions[s].segment  # noqa: SLF001
        assert segment is not None and segment.num_tokens == 47
        await engine.reset_prefix_cache()
        assert (await turn(m, s, unique_ids(2))).usage.cached_tokens == 47

    run(make_manager, body, idle_to_host_s=0.0, sweep_interval_s=3600.0)


@pytest.mark.parametrize("demotion", ["relieve", "pin_ends"])
def test_an_append_that_starts_during_a_demotion_keeps_its_pin(
        make_manager: ManagerFactory, engine: EngineClient, monkeypatch: pytest.MonkeyPatch,
        demotion: str) -> None:
    """The agent's next append arrives while its session is being copied to host (the engine
    short of memory: ``relieve``; or its pin ending). The append found no segment to resume from
    yet, so the pin is all that keeps its prefix on the GPU: it stays until the turn commits.
    (Released, eviction took the prefix and the turn recomputed it: turns with 0 cached tokens
    in an oversubscribed fleet.)"""
    async def body(m: SessionManager) -> None:
        ttl = 3600.0 if demotion == "relieve" else 0.3
        s = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(40)), ttl=ttl)).session_id
        await turn(m, s, unique_ids(3))
        session = m._sessions[s]  # noqa: SLF001
        pins = m._spill._pins  # noqa: SLF001
        released_under_a_turn: list[str] = []
        release = pins.release

        async def recording_release(target: Any, status: Any) -> None:
            if target.busy:
                released_under_a_turn.append(status)
            await release(target, status)

        appended: list[Any] = []
        export = engine.export_prefix

        async def export_as_the_agent_returns(*args: Any, **kwargs: Any) -> Any:
            if not appended:
                appended.append(await m.append(OWNER, s, SessionInput(input_ids=unique_ids(2)), greedy()))
            return await export(*args, **kwargs)

        monkeypatch.setattr(pins, "release", recording_release)
        monkeypatch.setattr(engine, "export_prefix", export_as_the_agent_returns)
        if demotion == "relieve":
            assert await m._spill.relieve()  # noqa: SLF001
            assert session.pin is not None and session.status == "active"
        else:
            await wait_for(lambda: bool(appended))
        result = await appended[0].result()
        assert released_under_a_turn == [], "a pin was released under the turn that needed it"
        assert result.usage.cached_tokens == 47

    run(make_manager, body, idle_to_host_s=0.0, sweep_interval_s=3600.0)


def test_fork_of_a_spilled_session_shares_its_segment_and_imports_once(
        make_manager: ManagerFactory, engine: EngineClient, index_config: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    imports: list[int] = []  # the spilled states requests carried (each loaded at admission)
    real_generate = engine.generate

    def counting_generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("resume") is not None:
            imports.append(kwargs["resume"].num_tokens)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", counting_generate)

    async def body(m: SessionManager) -> None:
        prompt, first = unique_ids(30), unique_ids(4)
        parent = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        twin = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        await turn(m, parent, first)
        await turn(m, twin, first)
        size = (await m.offload(OWNER, parent, "disk", wait=True)).num_tokens
        children = await m.fork(OWNER, parent, 2)
        assert [c.status for c in children] == ["disk", "disk"]
        segment = m._sessions[parent].segment  # noqa: SLF001
        assert segment is not None and segment.holders == {parent, *(c.session_id for c in children)}
        await m.delete(OWNER, parent)  # the children keep the shared segment
        assert m._store.disk.exists(parent, segment.segment_id)  # noqa: SLF001

        branch = unique_ids(3)
        expected, first_child = await twin_and_resumed(engine, m, twin, children[0].session_id, branch)
        second_child = await turn(m, children[1].session_id, branch)
        assert imports == [size], "imported once, by the first child"
        for child in (first_child, second_child):
            assert child.usage.cached_tokens == size and child.output_ids == expected.output_ids

    run(make_manager, body, **index_config)


@pytest.mark.parametrize("damage", ["truncated", "foreign", "tampered", "missing"])
def test_a_bad_segment_falls_back_to_recompute(make_manager: ManagerFactory, engine: EngineClient,
                                               damage: str) -> None:
    async def body(m: SessionManager) -> None:
        prompt, first = unique_ids(30), unique_ids(3)
        a = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        b = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
        await turn(m, a, first)
        await turn(m, b, first)
        await m.offload(OWNER, a, "disk", wait=True)
        segment = m._sessions[a].segment  # noqa: SLF001
        assert segment is not None
        disk: DiskStore = m._store.disk  # noqa: SLF001
        path = disk.path_for(a, segment.segment_id)
        good = disk.read(a, segment.segment_id, expect_fingerprint=None)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif damage == "missing":
            path.unlink()
        else:
            tensors = dict(good.tensors)
            fingerprint = good.meta.model_fingerprint
            if damage == "foreign":
                fingerprint = "another-model@sha256:0000000000000000"
            else:  # the same shapes and a valid header, but other tokens
                tensors["token_ids"] = tensors["token_ids"].flip(0).contiguous()
            disk.write(Segment.from_tensors(session_id=a, segment_id=segment.segment_id,
                                            model_fingerprint=fingerprint, tensors=tensors))
        twin, resumed = await twin_and_resumed(engine, m, b, a, unique_ids(4))
        assert resumed.usage.cached_tokens == 0, "recomputed from the token history"
        assert resumed.output_ids == twin.output_ids and resumed.turn == 2
        assert m._sessions[a].segment is None  # noqa: SLF001 (the bad segment is forgotten)

    run(make_manager, body)


@contextmanager
def file_size_limit(num_bytes: int) -> Iterator[None]:
    """Writes past ``num_bytes`` fail with EFBIG, like a full disk (SIGXFSZ ignored)."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (num_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


@pytest.mark.parametrize("fault", ["unwritable", "full"])
def test_a_failed_spill_leaves_the_session_resident(make_manager: ManagerFactory,
                                                    engine: EngineClient, fault: str) -> None:
    async def body(m: SessionManager) -> None:
        disk_root: Path = m._store.disk.root  # noqa: SLF001
        a = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(900)), ttl=0)).session_id
        before = await turn(m, a, unique_ids(96))  # ~1 MB of state
        turns = m.turns(OWNER, a, include_tokens=True)
        if fault == "unwritable":
            shutil.rmtree(disk_root)
            disk_root.write_text("not a directory")
            snap = await m.offload(OWNER, a, "disk", wait=True)
            disk_root.unlink()
            disk_root.mkdir()
        else:
            with file_size_limit(256 << 10):
                snap = await m.offload(OWNER, a, "disk", wait=True)
        assert snap.status == "idle" and m._sessions[a].segment is None  # noqa: SLF001
        assert list(disk_root.rglob("*")) == [], "no partial file is left"
        assert m.turns(OWNER, a, include_tokens=True) == turns
        after = await turn(m, a, unique_ids(2))
        assert after.usage.cached_tokens == before.num_tokens, "still resident on the GPU"
        assert (await m.offload(OWNER, a, "disk", wait=True)).status == "disk", "works once fixed"

    run(make_manager, body, host_budget_bytes=0)


@pytest.mark.slow  # a manager restarted over its data dir
def test_restart_resumes_from_disk_and_rebuilds_an_empty_index(
        make_manager: ManagerFactory, engine: EngineClient, index_config: dict[str, Any],
        tmp_path: Path) -> None:
    follow = unique_ids(3)

    async def main() -> None:
        # As after a crash: nothing is flushed to disk at close (test_graceful_close_... does).
        async with make_manager(**index_config, shutdown_flush_s=0) as m:
            made: dict[str, str] = {}
            for kind in ("disk", "host", "active", "twin"):
                s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(20)), ttl=0)
                await turn(m, s.session_id, unique_ids(3))
                made[kind] = s.session_id
            for kind in ("disk", "host"):
                await m.offload(OWNER, made[kind], kind, wait=True)  # type: ignore[arg-type]
            before = {k: m.turns(OWNER, sid, include_tokens=True) for k, sid in made.items()}
            ids = {k: sum((t.token_ids or () for t in v), ()) for k, v in before.items()}
        if "redis_url" in index_config:
            clear_prefix(index_config["redis_url"], index_config["redis_prefix"])
        else:
            for path in tmp_path.glob("index.sqlite*"):
                path.unlink()
        async with make_manager(**index_config) as m:
            assert {k: m.get(OWNER, sid).status for k, sid in made.items()} == dict.fromkeys(made, "disk")
            assert {k: m.turns(OWNER, sid, include_tokens=True) for k, sid in made.items()} == before
            assert index_record(m, made["disk"]).tier == "disk"  # type: ignore[union-attr]
            assert index_record(m, made["host"]).tier == "none"  # type: ignore[union-attr]
            results = {}
            for kind, sid in made.items():
                twin = await m.create(OWNER, content=SessionInput(input_ids=ids[kind]), ttl=0)
                await engine.reset_prefix_cache()
                expected = await turn(m, twin.session_id, follow)
                await engine.reset_prefix_cache()
                results[kind] = (expected, await turn(m, sid, follow))
            for kind, (expected, resumed) in results.items():
                assert resumed.output_ids == expected.output_ids, kind
                cached = len(ids[kind]) if kind == "disk" else 0
                assert resumed.usage.cached_tokens == cached, kind

    asyncio.run(main())


def test_graceful_close_writes_host_and_gpu_sessions_to_disk(
        make_manager: ManagerFactory, engine: EngineClient, index_config: dict[str, Any],
        caplog: pytest.LogCaptureFixture) -> None:
    """A graceful close demotes host segments and spills GPU-only sessions to disk, so after a
    restart each resumes from its segment (``cached_tokens`` = its history) with the tokens of a
    never-spilled twin; with no time for it, nothing is written."""
    follow = unique_ids(3)

    async def main() -> None:
        async with make_manager(**index_config) as m:
            made: dict[str, str] = {}
            for kind in ("host", "active", "idle"):
                s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(20)),
                                   ttl=0 if kind == "idle" else 300)
                await turn(m, s.session_id, unique_ids(3))
                made[kind] = s.session_id
            await m.offload(OWNER, made["host"], "host", wait=True)
            await wait_for(lambda: m.get(OWNER, made["idle"]).status == "idle")
            assert {k: m.get(OWNER, sid).status for k, sid in made.items()} == {k: k for k in made}
            ids = {k: sum((t.token_ids or () for t in m.turns(OWNER, sid, include_tokens=True)), ())
                   for k, sid in made.items()}
        assert "3 of 3 session state(s) written to disk" in caplog.text
        async with make_manager(**index_config) as m:
            assert {m.get(OWNER, sid).status for sid in made.values()} == {"disk"}
            assert {index_record(m, sid).tier for sid in made.values()} == {"disk"}  # type: ignore[union-attr]
            for kind, sid in made.items():
                twin = await m.create(OWNER, content=SessionInput(input_ids=ids[kind]), ttl=0)
                expected, resumed = await twin_and_resumed(engine, m, twin.session_id, sid, follow)
                assert resumed.output_ids == expected.output_ids, kind
                assert resumed.usage.cached_tokens == len(ids[kind]), kind

    caplog.set_level("INFO", logger="phloem.sessions.shutdown")
    asyncio.run(main())


def test_the_shutdown_flush_stops_at_its_time_limit(make_manager: ManagerFactory,
                                                    caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    async def main() -> list[str]:
        async with make_manager(shutdown_flush_s=1e-9) as m:
            made = []
            for _ in range(2):
                s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(20)))
                await turn(m, s.session_id, unique_ids(3))
                made.append(s.session_id)
        async with make_manager() as m:
            return [m.get(OWNER, sid).status for sid in made]

    caplog.set_level("INFO", logger="phloem.sessions.shutdown")
    assert asyncio.run(main()) == ["disk", "disk"]  # listed again; resumed by recompute
    assert "stopped at the 0 s limit: 0 of 2 written to disk" in caplog.text
    assert not list(tmp_path.rglob("*.safetensors")), "no segment was written"


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_a_session_spilled_under_tp2_resumes_under_tp1(
        make_manager: ManagerFactory, engine: EngineClient, model_dir: Path, tokenizer: Tokenizer,
        tmp_path: Path) -> None:
    """Segments hold the TP=1 layout (``engine.parallel.state_shards``): a TP=2 server's disk segment resumes
    on a TP=1 server as a full hit, with the tokens of a never-spilled twin."""
    prompt, follow = unique_ids(40), unique_ids(3)

    async def spill_under_tp2() -> tuple[str, tuple[int, ...]]:
        tp2 = EngineClient.from_pretrained(model_dir, EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2)))
        tp2.start()
        try:
            config = SessionConfig(data_dir=tmp_path)
            m = SessionManager(tp2, tokenizer, config, model_fingerprint=model_fingerprint(model_dir))
            await m.start()
            try:
                sid = (await m.create(OWNER, content=SessionInput(input_ids=prompt), ttl=0)).session_id
                await turn(m, sid, unique_ids(3))
                snap = await m.offload(OWNER, sid, "disk", wait=True)
                assert snap.status == "disk"
                ids = sum((t.token_ids or () for t in m.turns(OWNER, sid, include_tokens=True)), ())
            finally:
                await m.close()
        finally:
            await tp2.shutdown()
        return sid, ids

    async def resume_under_tp1(sid: str, ids: tuple[int, ...]) -> None:
        async with make_manager() as m:
            assert m.get(OWNER, sid).status == "disk"
            twin = await m.create(OWNER, content=SessionInput(input_ids=ids), ttl=0)
            await engine.reset_prefix_cache()
            expected = await turn(m, twin.session_id, follow)
            await engine.reset_prefix_cache()
            resumed = await turn(m, sid, follow)
            assert resumed.usage.cached_tokens == len(ids), "the TP=2 segment was imported"
            assert resumed.output_ids == expected.output_ids

    sid, ids = asyncio.run(spill_under_tp2())
    asyncio.run(resume_under_tp1(sid, ids))


@pytest.mark.slow  # waits out Redis timeouts
def test_redis_unreachable_at_start_and_mid_run_degrades_and_resyncs(
        make_manager: ManagerFactory) -> None:
    url, prefix = require_redis(), random_prefix()
    proxy = TcpProxy(url)  # not listening yet: Redis is unreachable at start
    index = RedisIndex(url, prefix=prefix)

    async def main() -> None:
        async with make_manager(redis_url=proxy.url, redis_prefix=prefix,
                                sweep_interval_s=0.05) as m:
            assert "unavailable" in (m.health() or "")
            a = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(10)))).session_id
            first = await turn(m, a, unique_ids(2))
            proxy.restore()
            await wait_for(lambda: m.health() is None)
            record = index.get_session(a)
            assert record is not None and record.num_tokens == first.num_tokens

            proxy.cut()  # mid-run
            b = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(10)))).session_id
            second = await turn(m, a, unique_ids(2))
            assert "unavailable" in (m.health() or "")
            await m.delete(OWNER, b)
            assert m.turns(OWNER, a)[-1].end == second.num_tokens
            proxy.delay_s = 0.05  # a slow resync: health is ok only once it has written
            proxy.restore()
            await wait_for(lambda: m.health() is None)
            assert index.get_session(a).num_tokens == second.num_tokens  # type: ignore[union-attr]
            assert index.get_session(b) is None

    try:
        asyncio.run(main())
    finally:
        proxy.cut()
        index.clear()
        index.close()


@pytest.mark.parametrize("short_of", [pytest.param("slots", marks=pytest.mark.slow), "pages"])
def test_pinned_sessions_never_block_admission(model_dir: Path, tokenizer: Tokenizer,
                                               tmp_path: Path, short_of: str) -> None:
    # Four sessions pinned for a long TTL hold every slot (or nearly every page) of a small engine.
    cache = (CacheConfig(num_state_slots=4) if short_of == "slots"
             else CacheConfig(num_pages=12, num_state_slots=16))

    async def body(m: SessionManager, engine: EngineClient) -> None:
        del engine
        pinned = []
        for _ in range(4 if short_of == "slots" else 2):
            s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(60)), ttl=600)
            await turn(m, s.session_id, unique_ids(4))
            pinned.append(s.session_id)
        assert {m.get(OWNER, sid).status for sid in pinned} == {"active"}
        newcomer = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(60)))
        result = await asyncio.wait_for(turn(m, newcomer.session_id, unique_ids(4)), 30)
        assert len(result.output_ids) == 4
        demoted = [sid for sid in pinned if m.get(OWNER, sid).status == "host"]
        assert demoted and demoted == pinned[: len(demoted)], "the least recently used first"
        resumed = await asyncio.wait_for(turn(m, demoted[0], unique_ids(2)), 30)
        assert resumed.usage.cached_tokens > 0

    on_a_small_engine(model_dir, tokenizer, tmp_path, cache, 0.2, body)


def on_a_small_engine(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path, cache: CacheConfig,
                      stall_s: float, body: Callable[[SessionManager, EngineClient], Awaitable[None]]) -> None:
    """``body`` on a session manager over an engine with ``cache``'s pools (and on that engine),
    sessions waiting ``stall_s`` for memory."""
    engine = EngineClient.from_pretrained(model_dir, EngineConfig(cache=cache))
    engine.start()
    config = SessionConfig(data_dir=tmp_path, admission_stall_s=stall_s)

    async def main() -> None:
        m = SessionManager(engine, tokenizer, config, model_fingerprint=model_fingerprint(model_dir))
        await m.start()
        try:
            await body(m, engine)
        finally:
            await m.close()

    try:
        asyncio.run(main())
    finally:
        asyncio.run(engine.shutdown())


@pytest.mark.slow  # two 600-token prefills in 16-token chunks
def test_waiting_behind_long_prefills_demotes_nobody(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two long first turns in small chunks: the second's first token comes only after both
    prompts' chunks ran (it waited its turn), the admission watchdog asked the engine while it
    waited, the engine never said "for memory", and no pinned session moves.

    Ordered by engine steps and the watchdog's own questions, never by wall-clock time, so a
    loaded CPU cannot fail it (nor hide a demotion: the watchdog polls every 10 ms here, with a
    10 ms stall threshold, so a demotion for mere waiting would happen within the wait)."""
    from phloem.sessions import generation as generation_module

    monkeypatch.setattr(generation_module, "_POLL_S", 0.01)
    budget, prompt = 16, 600
    engine = EngineClient.from_pretrained(model_dir, EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=budget)))
    engine.start()
    config = SessionConfig(data_dir=tmp_path,
                           admission_stall_s=0.01)
    answers: list[bool] = []  # the engine's answers to the watchdog: waiting for memory?
    asked = engine.waits_for_memory

    async def waits_for_memory(request_id: str) -> bool:
        answers.append(await asked(request_id))
        return answers[-1]

    monkeypatch.setattr(engine, "waits_for_memory", waits_for_memory)

    async def main() -> None:
        m = SessionManager(engine, tokenizer, config, model_fingerprint=model_fingerprint(model_dir))
        await m.start()
        relieved: list[Any] = []
        relieve = m._spill.relieve

        async def counted_relieve(*args: Any, **kwargs: Any) -> bool:
            relieved.append(args)
            return await relieve(*args, **kwargs)

        monkeypatch.setattr(m._spill, "relieve", counted_relieve)
        try:
            pinned = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(20)), ttl=600)
            await turn(m, pinned.session_id, unique_ids(2))
            steps_before = (await engine.stats()).num_steps
            a = await m.create(OWNER)
            b = await m.create(OWNER)

            async def first_token_step(session_id: str) -> int:
                generation = await m.append(OWNER, session_id, SessionInput(input_ids=unique_ids(prompt)), greedy())
                step = None
                async for _ in generation.deltas():
                    # Read after the token arrived: at or past the step that made it.
                    step = (await engine.stats()).num_steps if step is None else step
                await generation.result()
                assert step is not None
                return step - steps_before

            first_steps = await asyncio.gather(first_token_step(a.session_id), first_token_step(b.session_id))
            # Each step computes at most `budget` prompt tokens: the later first token needed both prompts.
            assert max(first_steps) >= 2 * prompt // budget, f"the second did not wait: {first_steps}"
            assert answers, "the admission watchdog never asked about a waiting request"
            assert not any(answers), "the engine said a request waited for memory"
            assert relieved == [], "pinned sessions were demoted for a request that only waited its turn"
            assert m.get(OWNER, pinned.session_id).status == "active"
        finally:
            await m.close()

    try:
        asyncio.run(main())
    finally:
        asyncio.run(engine.shutdown())


def test_sqlite_index_matches_the_journal_after_spills(make_manager: ManagerFactory,
                                                       tmp_path: Path) -> None:
    async def body(m: SessionManager) -> None:
        a = (await m.create(OWNER, content=SessionInput(input_ids=unique_ids(20)), ttl=0)).session_id
        await turn(m, a, unique_ids(2))
        await m.offload(OWNER, a, "disk", wait=True)
        index = SQLiteIndex(tmp_path / "index.sqlite")
        record = index.get_session(a)
        index.close()
        assert record is not None and record.tier == "disk" and record.segment_id is not None

    run(make_manager, body)



def with_a_pin_no_session_owns(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path,
                               before: Callable[[SessionManager, EngineClient], Awaitable[T]],
                               body: Callable[[SessionManager, T], Awaitable[None]],
                               pinned_s: float = 0.3, stall_s: float = 5.0, hold_s: float = 5.0) -> None:
    """A 12-page engine (hand-off holds of ``hold_s``); ``before`` runs, then 150 tokens (10 of
    the pages) are prefilled and pinned by no session (nothing to demote), ``body`` runs while
    the pin goes ``pinned_s`` later; sessions wait ``stall_s`` for memory."""
    async def pinned(m: SessionManager, engine: EngineClient) -> None:
        ready = await before(m, engine)
        hog = unique_ids(150)
        await engine.prefill(hog)
        handle = await engine.pin_prefix(hog)
        assert handle is not None

        async def let_go() -> None:
            await asyncio.sleep(pinned_s)
            await engine.unpin_prefix(handle)

        releaser = asyncio.create_task(let_go())
        await asyncio.wait_for(body(m, ready), 30)
        await releaser

    cache = CacheConfig(num_pages=12, num_state_slots=16, handoff_hold_s=hold_s)
    on_a_small_engine(model_dir, tokenizer, tmp_path, cache, stall_s, pinned)


def test_a_resume_with_no_room_waits_for_memory_instead_of_recomputing(model_dir: Path, tokenizer: Tokenizer,
                                                                       tmp_path: Path) -> None:
    """A spilled session's next turn finds the pool locked by a pin no session owns: its request,
    carrying the spilled state, waits for room and loads it as it is admitted once the pin goes,
    so the turn is a hit on the spilled prefix rather than a recompute of it."""
    async def spilled(m: SessionManager, engine: EngineClient) -> tuple[str, int]:
        s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(60)), ttl=0)
        first = await turn(m, s.session_id, unique_ids(4))
        await m.offload(OWNER, s.session_id, "host", wait=True)
        assert m.get(OWNER, s.session_id).status == "host"
        await engine.reset_prefix_cache()
        return s.session_id, first.usage.prompt_tokens

    async def next_turn(m: SessionManager, ready: tuple[str, int]) -> None:
        session_id, history = ready
        result = await turn(m, session_id, unique_ids(2))
        assert result.usage.cached_tokens >= history, result.usage

    with_a_pin_no_session_owns(model_dir, tokenizer, tmp_path, spilled, next_turn)


def test_a_request_turned_away_for_room_is_sent_again_until_memory_returns(model_dir: Path, tokenizer: Tokenizer,
                                                                           tmp_path: Path) -> None:
    """A lone request finds the pools locked by a pin no session owns (nothing to demote): it
    waits in the engine while the pin may go, and runs once it goes, within
    ``admission_stall_s``, instead of failing ``Overloaded``."""
    async def fresh(m: SessionManager, engine: EngineClient) -> str:
        del engine
        return (await m.create(OWNER)).session_id

    async def first_turn(m: SessionManager, session_id: str) -> None:
        result = await turn(m, session_id, unique_ids(60))
        assert len(result.output_ids) == 4

    with_a_pin_no_session_owns(model_dir, tokenizer, tmp_path, fresh, first_turn)


def test_a_turn_nothing_can_make_room_for_is_overloaded(model_dir: Path, tokenizer: Tokenizer,
                                                       tmp_path: Path) -> None:
    """The pool is locked by a pin no session owns, for longer than the turn should wait:
    nothing runs and nothing can be demoted. The turn waits in the engine (a pin may go), then,
    ``admission_stall_s`` after the sessions layer found nothing to free, is ``Overloaded``
    (the client retries later), rather than waiting for the pin or the client's timeout."""
    async def fresh(m: SessionManager, engine: EngineClient) -> str:
        del engine
        return (await m.create(OWNER)).session_id

    async def first_turn(m: SessionManager, session_id: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(Overloaded):
            await turn(m, session_id, unique_ids(60))
        assert loop.time() - started < 4.0

    with_a_pin_no_session_owns(model_dir, tokenizer, tmp_path, fresh, first_turn, pinned_s=6.0, stall_s=0.3)


def test_a_turn_waits_out_a_hold_and_then_a_pin(model_dir: Path, tokenizer: Tokenizer,
                                                tmp_path: Path) -> None:
    """A request waits 3 s in the engine behind a hand-off hold (an imported prefix no request
    claims) and a pin no session owns, which goes 0.5 s after the hold expires. Nothing can be
    demoted, but a hold ends by itself: the turn is not given up while it lasts
    (``MemoryWait.FOR_MEMORY``), only ``admission_stall_s`` (2 s) after the hold is gone with
    nothing left to free; the pin goes before that, and the turn runs."""
    async def held(m: SessionManager, engine: EngineClient) -> tuple[str, float]:
        small = unique_ids(20)
        await engine.prefill(small)
        state = await engine.export_prefix(small)
        assert state is not None
        await engine.reset_prefix_cache()
        assert await engine.import_prefix(state)  # held until a request takes it: none will
        return (await m.create(OWNER)).session_id, asyncio.get_running_loop().time()

    async def first_turn(m: SessionManager, ready: tuple[str, float]) -> None:
        session_id, held_at = ready
        result = await turn(m, session_id, unique_ids(60))
        assert len(result.output_ids) == 4
        assert asyncio.get_running_loop().time() - held_at >= 3.0, "it ran before the hold expired"

    with_a_pin_no_session_owns(model_dir, tokenizer, tmp_path, held, first_turn,
                               pinned_s=3.5, stall_s=2.0, hold_s=3.0)


def test_turns_waiting_on_each_others_pins_step_aside(model_dir: Path, tokenizer: Tokenizer,
                                                      tmp_path: Path) -> None:
    """Two pinned sessions (long TTL) append at once, and the two turns cannot both fit beside
    the two pins: each turn waits for memory the other's pin holds, nothing runs and no pinned
    session is idle to demote. One session lets go of its pin, its head copied to host and
    handed to its waiting request (``Spiller._step_aside``), so the other runs; then it loads
    its state back as it is admitted. Both turns complete, both on their cached history."""
    async def body(m: SessionManager, engine: EngineClient) -> None:
        del engine
        sessions, history = [], []
        for _ in range(2):
            s = await m.create(OWNER, content=SessionInput(input_ids=unique_ids(50)), ttl=600)
            history.append((await turn(m, s.session_id, unique_ids(4))).usage.prompt_tokens)
            sessions.append(s.session_id)
        assert {m.get(OWNER, sid).status for sid in sessions} == {"active"}
        results = await asyncio.wait_for(
            asyncio.gather(*(turn(m, sid, unique_ids(60)) for sid in sessions)), 30)
        for result, seen in zip(results, history):
            assert len(result.output_ids) == 4
            assert result.usage.cached_tokens >= seen, result.usage

    on_a_small_engine(model_dir, tokenizer, tmp_path, CacheConfig(num_pages=12, num_state_slots=16), 0.2, body)
