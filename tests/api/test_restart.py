"""Crash and restart of a real server: ``kill -9`` with 20 sessions (active, idle, spilled to host
and to disk, forks of a spilled session), then a new server on the same data directory.

Every session must come back with its full turn history, and its next greedy turn must equal what
a fresh engine computes from the same history (a never-spilled twin); sessions spilled to disk
resume from their segment (``cached_tokens`` = their history), the others by recompute. With
Redis, the index is flushed (this test's prefix only) before the restart, so the new server must
rebuild it from the data directory.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from live_servers import ServerProcess
from redis_support import clear_prefix, random_prefix, require_redis

from phloem.api import Client, Session
from phloem.engine import Engine, SamplingParams
from phloem.runtime.builtin_model import trained_model_path
from phloem.storage import RedisIndex

pytestmark = pytest.mark.slow  # phloem serve processes of its own

NUM_SESSIONS = 20
GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


def unique_ids(n: int) -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(3, 1900) for _ in range(n)]


def eventually(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        time.sleep(0.05)


@pytest.fixture(params=["sqlite", "redis"])
def index_flags(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Server flags/env of each index backend; Redis under a fresh prefix, deleted afterwards."""
    if request.param == "sqlite":
        yield {"args": (), "env": {}, "flush": None}
        return
    url, prefix = require_redis(), random_prefix()
    try:
        yield {"args": ("--redis-url", url), "env": {"PHLOEM_REDIS_PREFIX": prefix},
               "flush": (url, prefix)}
    finally:
        clear_prefix(url, prefix)


def history(session: Session) -> list[int]:
    return [t for turn in session.turns(include_tokens=True) for t in (turn.token_ids or ())]


def test_kill_9_then_restart_keeps_and_resumes_every_session(tmp_path: Path,
                                                             index_flags: dict[str, Any]) -> None:
    model_dir = trained_model_path()  # what the servers below serve: no --model
    first = ServerProcess(tmp_path, index_flags["args"], dict(index_flags["env"])).start()
    try:
        with Client(first.base_url, timeout=60) as client:
            sessions = []
            for i in range(NUM_SESSIONS - 2):
                # ttl 600: still pinned (active) at the crash; ttl 0: idle right after its turn.
                s = client.sessions.create(input_ids=unique_ids(24), ttl=600 if i % 3 == 0 else 0)
                s.append(input_ids=unique_ids(4), generate=GREEDY)
                sessions.append(s)
            tiers = {s.id: "host" if i % 3 == 1 else "disk" for i, s in enumerate(sessions)
                     if i % 3}
            for s in sessions:
                if s.id in tiers:
                    s.offload(tiers[s.id])  # type: ignore[arg-type]
            for s in sessions:
                if s.id in tiers:
                    eventually(lambda s=s: s.refresh().status == tiers[s.id])
            spilled_parent = next(s for s in sessions if tiers.get(s.id) == "disk")
            children = spilled_parent.fork(2)
            assert [c.info.status for c in children] == ["disk", "disk"]
            sessions += children
            before = {s.id: (s.turns(include_tokens=True), history(s)) for s in sessions}
            assert len(before) == NUM_SESSIONS
        first.kill()
    finally:
        first.stop()
    if index_flags["flush"] is not None:
        url, prefix = index_flags["flush"]
        clear_prefix(url, prefix)

    second = ServerProcess(tmp_path, index_flags["args"], dict(index_flags["env"])).start()
    try:
        with Client(second.base_url, timeout=60) as client:
            listed = {s.id: s for s in client.sessions.list()}
            assert set(listed) == set(before), "every acknowledged session is listed"
            assert {s.info.status for s in listed.values()} == {"disk"}
            assert {sid: s.turns(include_tokens=True) for sid, s in listed.items()} == \
                {sid: turns for sid, (turns, _) in before.items()}
            if index_flags["flush"] is not None:
                url, prefix = index_flags["flush"]
                index = RedisIndex(url, prefix=prefix)
                rebuilt = {r.session_id: r.tier for r in index.list_sessions()}
                index.close()
                assert set(rebuilt) == set(before), "the index was rebuilt from the data dir"
                assert rebuilt[spilled_parent.id] == "disk"

            engine = Engine.from_pretrained(model_dir)
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            for sid, session in listed.items():
                tokens = before[sid][1]
                # Each its own: forks share their history, and a shared continuation would hit
                # the cache past it (a branch checkpoint), hiding what came from the disk.
                follow = unique_ids(3)
                result = session.append(input_ids=follow, generate=GREEDY)
                twin = engine.generate([tokens + follow], params)[0]
                assert list(result.output_ids) == twin.token_ids, sid
                if sid == spilled_parent.id or tiers.get(sid) == "disk":
                    assert result.usage.cached_tokens == len(tokens), f"{sid} resumed from disk"
            engine.close()
    finally:
        second.stop()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_graceful_stop_writes_host_and_gpu_sessions_to_disk(tmp_path: Path, stop: signal.Signals) -> None:
    """SIGTERM or Ctrl-C: sessions held in host memory and on the GPU are written to disk before
    the server exits (with log lines saying so), so after a restart every one resumes from its
    segment instead of recomputing."""
    first = ServerProcess(tmp_path).start()
    assert first.process is not None
    with Client(first.base_url, timeout=60) as client:
        sessions = []
        for ttl in (600, 0, 600):
            s = client.sessions.create(input_ids=unique_ids(24), ttl=ttl)
            s.append(input_ids=unique_ids(4), generate=GREEDY)
            sessions.append(s)
        sessions[2].offload("host")
        eventually(lambda: sessions[2].refresh().status == "host")
        before = {s.id: history(s) for s in sessions}
    first.process.send_signal(stop)
    assert first.process.wait(timeout=60) == 0
    assert first.log is not None
    log = first.log.read_text()
    assert "shutdown: writing 3 session state(s) to disk (1 from host memory, 2 from the GPU)" in log
    assert "shutdown: 3 of 3 session state(s) written to disk" in log

    second = ServerProcess(tmp_path).start()
    try:
        with Client(second.base_url, timeout=60) as client:
            for sid, tokens in before.items():
                result = client.sessions.get(sid).append(input_ids=unique_ids(3), generate=GREEDY)
                assert result.usage.cached_tokens == len(tokens), f"{sid} resumed from disk"
    finally:
        second.stop()
