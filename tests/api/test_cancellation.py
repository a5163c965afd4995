"""A client that goes away mid-stream cancels its generation, and the engine gets its pages and
slot back: checked on the engine client's own ``stats()`` (uvicorn runs in a thread of this
process, so the disconnects are real socket closes). SSE, WebSocket and the OpenAI stream; a
non-streamed append, by contract, still completes and commits."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_servers import LiveApp, live_app
from websockets.sync.client import connect

from phloem.cli.config import ServerConfig
from phloem.sessions.config import SessionConfig
from phloem.runtime import EngineStats, ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME

pytestmark = pytest.mark.slow  # an engine and app in process

LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApp]:
    config = ServerConfig(sessions=SessionConfig(data_dir=tmp_path_factory.mktemp("cancel")))
    with live_app(ensure_default_model(data_dir), config) as served:
        yield served


@pytest.fixture
def http(app: LiveApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.base_url, timeout=30) as client:
        yield client


def held_by_requests(stats: EngineStats) -> tuple[int, int]:
    """(pages, slots) that belong to requests rather than to the prefix cache: the cache holds
    the pages of its tree plus at most one tail page and exactly one slot per checkpoint."""
    cache = stats.cache
    return (max(0, cache.pages_in_use - cache.pages_in_tree - cache.checkpoints),
            cache.slots_in_use - cache.checkpoints)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def last_turn(http: httpx.Client, session: str, num_turns: int) -> dict[str, Any]:
    turns = wait_for(lambda: (t := http.get(f"/v1/sessions/{session}/turns").json()["turns"])
                     and len(t) == num_turns and t)
    return dict(turns[-1])


def assert_released(app: LiveApp) -> None:
    stats = app.wait_idle()
    assert stats.num_requests == 0
    assert held_by_requests(stats) == (0, 0), f"pages or a slot still held by a request: {stats}"


def running(app: LiveApp) -> bool:
    stats = app.stats()
    pages, slots = held_by_requests(stats)
    return stats.num_requests == 1 and pages > 0 and slots == 1


def test_sse_client_disconnect_cancels_and_releases(app: LiveApp, http: httpx.Client) -> None:
    session = http.post("/v1/sessions", json={"text": "sse"}).json()["id"]
    app.wait_idle()
    body = {"text": " go", "generate": LONG, "stream": True}
    with http.stream("POST", f"/v1/sessions/{session}/append", json=body) as stream:
        data = (line for line in stream.iter_lines() if line.startswith("data:"))
        seen = [json.loads(next(data)[5:]) for _ in range(3)]
        assert running(app), "the generation holds a slot while it runs"
    turn = last_turn(http, session, 2)
    assert turn["finish_reason"] == "cancelled"
    assert 3 <= turn["num_output_tokens"] < 4000
    assert sum(len(e["token_ids"]) for e in seen) <= turn["num_output_tokens"]
    assert_released(app)


def test_websocket_client_disconnect_cancels_and_releases(app: LiveApp, http: httpx.Client) -> None:
    session = http.post("/v1/sessions", json={"text": "ws"}).json()["id"]
    app.wait_idle()
    with connect(f"{app.ws_url}/v1/sessions/{session}/ws") as ws:
        ws.send(json.dumps({"type": "append", "text": " go", "generate": LONG}))
        assert [json.loads(ws.recv(timeout=10))["type"] for _ in range(3)] == ["delta"] * 3
        assert running(app)
    turn = last_turn(http, session, 2)
    assert turn["finish_reason"] == "cancelled" and turn["num_output_tokens"] < 4000
    assert_released(app)


def test_openai_stream_disconnect_cancels_and_releases(app: LiveApp, http: httpx.Client) -> None:
    app.wait_idle()
    body = {"model": RANDOM_MODEL_NAME, "prompt": "once upon", "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        data = (line for line in stream.iter_lines() if line.startswith("data:"))
        for _ in range(3):
            next(data)
        assert running(app)
    assert_released(app)


def test_a_dropped_socket_mid_request_cancels_too(app: LiveApp, http: httpx.Client) -> None:
    """A TCP reset right after the request (no orderly close) is noticed the same way."""
    session = http.post("/v1/sessions", json={"text": "rst"}).json()["id"]
    app.wait_idle()
    body = json.dumps({"text": " go", "generate": LONG, "stream": True}).encode()
    host, port = app.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(f"POST /v1/sessions/{session}/append HTTP/1.1\r\nHost: {host}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert b"event: delta" in raw.recv(65536) or wait_for(lambda: running(app))
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert last_turn(http, session, 2)["finish_reason"] == "cancelled"
    assert_released(app)


def test_a_plain_append_completes_after_its_client_left(app: LiveApp, http: httpx.Client) -> None:
    session = http.post("/v1/sessions", json={"text": "plain"}).json()["id"]
    body = {"text": " go", "generate": {**LONG, "max_tokens": 300}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{app.base_url}/v1/sessions/{session}/append", json=body,
                   timeout=httpx.Timeout(10, read=0.05))
    turn = last_turn(http, session, 2)
    assert (turn["finish_reason"], turn["num_output_tokens"]) == ("length", 300)


def test_a_client_that_hangs_up_while_its_grammar_is_queued_never_gets_it_compiled(
        app: LiveApp, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream notices a hang-up at its next write: while a request waits for its compile
    nothing is written, so the compile budget ends the wait (here 2 s) and drops the queued
    compile; with tokens flowing, a hang-up cancels at once (the tests above)."""
    backend, pool = app.engine._grammar, app.engine._compiles
    assert backend is not None and pool is not None
    monkeypatch.setattr(pool, "config", dataclasses.replace(pool.config, compile_timeout_s=2.0))
    release, compiled = threading.Event(), []
    original = backend.compile

    def slow(spec: Any, owner: str | None = None) -> Any:
        compiled.append(spec.source)
        if "hang-" in spec.source:
            assert release.wait(30)
        return original(spec, owner)

    monkeypatch.setattr(backend, "compile", slow)
    abandoned = pool.num_abandoned

    def hasty(tag: str) -> None:
        schema = {"type": "object", "properties": {"a": {"const": tag}}}
        body = {"model": RANDOM_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "stream": True,
                "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        with httpx.Client(base_url=app.base_url, timeout=0.5) as client, contextlib.suppress(httpx.TimeoutException):
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass

    first = threading.Thread(target=hasty, args=("hang-1",))
    first.start()
    wait_for(lambda: compiled)  # hang-1 holds the key's one compile slot
    hasty("hang-2")  # queued behind it; hangs up after 0.5 s
    first.join()
    wait_for(lambda: pool.num_abandoned == abandoned + 1)
    release.set()
    wait_for(lambda: not pool.running(None))
    assert [s for s in compiled if "hang-" in s] == [compiled[0]], "hang-2's compile never started"
    app.wait_idle()
