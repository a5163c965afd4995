"""Limits with clear errors, on real sockets (uvicorn in a thread) with tiny limits: body size
(413), context length (400), sessions and generations per key (429 + Retry-After), global
overload (503 + Retry-After), and the idle-stream timeout (SSE, WebSocket, OpenAI stream: the
generation is cancelled and the stream ends cleanly; an idle socket is closed).

The engine runs one sequence at a time (``max_num_seqs=1``): while alice's long generation runs,
any other generation waits in the engine's queue and produces nothing, which is exactly what the
idle timeout is for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_servers import LiveApp, live_app
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from phloem.api.server.config import ApiKey, HttpConfig
from phloem.cli.config import ServerConfig
from phloem.sessions.config import SessionConfig
from phloem.engine import EngineConfig, SchedulerConfig
from phloem.runtime import ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME

pytestmark = pytest.mark.slow  # an engine and app in process

ALICE, BOB, CAROL = "alice-key-0123456789", "bob-key-0123456789ab", "carol-key-0123456789"
MAX_SESSIONS = 3
IDLE_S = 2.0
LONG = {"max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def app(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApp]:
    config = ServerConfig(
        engine=EngineConfig(scheduler=SchedulerConfig(max_num_seqs=1, max_model_len=4096)),
        sessions=SessionConfig(data_dir=tmp_path_factory.mktemp("limits"), max_num_generations=2, retry_after_s=3.0),
        http=HttpConfig(max_body_bytes=64 * 1024, api_keys=(ApiKey(ALICE), ApiKey(BOB), ApiKey(CAROL)),
                        max_sessions_per_key=MAX_SESSIONS, max_generations_per_key=1, stream_idle_timeout_s=IDLE_S))
    with live_app(ensure_default_model(data_dir), config) as served:
        yield served


def http(app: LiveApp, key: str) -> httpx.Client:
    return httpx.Client(base_url=app.base_url, timeout=30, headers={"Authorization": f"Bearer {key}"})


def new_session(client: httpx.Client, **body: Any) -> str:
    response = client.post("/v1/sessions", json=body or {"text": "hello"})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    return body


@contextmanager
def busy_engine(app: LiveApp) -> Iterator[httpx.Client]:
    """Alice runs one long SSE generation (her quota, and the engine's one sequence)."""
    with http(app, ALICE) as alice:
        session = new_session(alice)
        body = {"text": " go", "generate": LONG, "stream": True}
        with alice.stream("POST", f"/v1/sessions/{session}/append", json=body) as stream:
            assert stream.status_code == 200
            # NOTE: keep the line iterator alive: a closed one closes the connection.
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            yield alice
        # Leaving the block closed the stream: the generation is cancelled.
        alice.delete(f"/v1/sessions/{session}")
    app.wait_idle()


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]


def test_body_over_the_limit_is_413(app: LiveApp) -> None:
    with http(app, ALICE) as alice:
        big = {"text": "x" * (70 * 1024)}
        problem(alice.post("/v1/sessions", json=big), 413, "payload_too_large")
        chat = alice.post("/v1/chat/completions", json={"model": "m", "messages": [
            {"role": "user", "content": "x" * (70 * 1024)}]})
        assert chat.status_code == 413 and chat.json()["error"]["code"] == "payload_too_large"
        assert alice.get("/v1/sessions").json()["sessions"] == []


def test_context_over_the_limit_is_400(app: LiveApp) -> None:
    with http(app, ALICE) as alice:
        models = alice.get("/v1/models").json()
        assert models["data"][0]["max_model_len"] == 4096
        problem(alice.post("/v1/sessions", json={"input_ids": [7] * 4097}),
                400, "context_length_exceeded")
        session = new_session(alice, input_ids=[7] * 4000)
        problem(alice.post(f"/v1/sessions/{session}/append",
                           json={"input_ids": [8] * 96, "generate": {"max_tokens": 1}}),
                400, "context_length_exceeded")
        assert len(alice.get(f"/v1/sessions/{session}/turns").json()["turns"]) == 1
        # A max_tokens beyond the window is clamped, never an error.
        result = alice.post(f"/v1/sessions/{session}/append",
                            json={"input_ids": [8] * 90, "generate": {**LONG, "max_tokens": 50}})
        assert result.status_code == 200, result.text
        assert result.json()["finish_reason"] == "length" and result.json()["num_tokens"] == 4096
        alice.delete(f"/v1/sessions/{session}")


def test_sessions_per_key_are_429_with_retry_after(app: LiveApp) -> None:
    with http(app, ALICE) as alice, http(app, BOB) as bob:
        mine = [new_session(alice) for _ in range(MAX_SESSIONS)]
        over = alice.post("/v1/sessions", json={"text": "one more"})
        problem(over, 429, "rate_limited")
        assert over.headers["retry-after"] == "3"
        problem(alice.post(f"/v1/sessions/{mine[0]}/fork", json={"n": 1}), 429, "rate_limited")
        assert len(alice.get("/v1/sessions").json()["sessions"]) == MAX_SESSIONS
        # The quota is per key; and deleting makes room again.
        theirs = new_session(bob)
        assert alice.delete(f"/v1/sessions/{mine.pop()}").status_code == 204
        problem(alice.post(f"/v1/sessions/{mine[0]}/fork", json={"n": 2}), 429, "rate_limited")
        with connect(f"{app.ws_url}/v1/sessions/{mine[0]}/ws",
                     additional_headers={"Authorization": f"Bearer {ALICE}"}) as ws:
            ws.send(json.dumps({"type": "fork", "n": 2}))
            assert json.loads(ws.recv(timeout=10))["code"] == "rate_limited"
        forked = alice.post(f"/v1/sessions/{mine[0]}/fork", json={"n": 1})
        assert forked.status_code == 201, forked.text
        for sid in [*mine, forked.json()["sessions"][0]["id"]]:
            assert alice.delete(f"/v1/sessions/{sid}").status_code == 204
        bob.delete(f"/v1/sessions/{theirs}")


def test_generations_per_key_are_429_and_global_overload_is_503(app: LiveApp) -> None:
    with busy_engine(app) as alice, http(app, BOB) as bob, http(app, CAROL) as carol:
        other = new_session(alice)
        over = alice.post(f"/v1/sessions/{other}/append", json={"text": "x", "generate": {"max_tokens": 1}})
        problem(over, 429, "rate_limited")
        assert over.headers["retry-after"] == "3"
        # Input without generation is not a generation: it commits.
        assert alice.post(f"/v1/sessions/{other}/append", json={"text": "x"}).status_code == 200
        chat = alice.post("/v1/chat/completions", json={"model": RANDOM_MODEL_NAME, "messages": [
            {"role": "user", "content": "x"}], "max_tokens": 1})
        assert chat.status_code == 429 and chat.json()["error"]["code"] == "rate_limited"
        with connect(f"{app.ws_url}/v1/sessions/{other}/ws",
                     additional_headers={"Authorization": f"Bearer {ALICE}"}) as ws:
            ws.send(json.dumps({"type": "append", "generate": {"max_tokens": 1}, "request_id": "r"}))
            event = json.loads(ws.recv(timeout=10))
            assert (event["type"], event["code"], event["retry_after"]) == ("error", "rate_limited", 3.0)
            ws.send(json.dumps({"type": "cancel"}))
            assert json.loads(ws.recv(timeout=10))["type"] == "cancelled", "the socket stays open"
        # Bob's generation is the server's second (its limit): it waits in the engine's queue...
        bobs = new_session(bob)
        body = {"text": "y", "generate": {"max_tokens": 2}, "stream": True}
        with bob.stream("POST", f"/v1/sessions/{bobs}/append", json=body) as waiting:
            assert waiting.status_code == 200
            # ...so carol's is over the global limit.
            carols = new_session(carol)
            full = carol.post(f"/v1/sessions/{carols}/append", json={"text": "z", "generate": {"max_tokens": 1}})
            problem(full, 503, "overloaded")
            assert full.headers["retry-after"] == "3"
            events = sse_events(waiting)
        # Bob's never got a token: after the idle timeout it was cancelled, and ended cleanly.
        assert [e["type"] for e in events] == ["done"]
        assert (events[0]["finish_reason"], events[0]["output_ids"]) == ("cancelled", [])
        turns = bob.get(f"/v1/sessions/{bobs}/turns").json()["turns"]
        assert (turns[-1]["finish_reason"], turns[-1]["num_output_tokens"]) == ("cancelled", 0)
        alice.delete(f"/v1/sessions/{other}")
        bob.delete(f"/v1/sessions/{bobs}")
        carol.delete(f"/v1/sessions/{carols}")
    stats = app.wait_idle()
    assert stats.num_requests == 0


def test_idle_websocket_generation_is_cancelled_then_the_socket_closes(app: LiveApp) -> None:
    with busy_engine(app), http(app, BOB) as bob:
        session = new_session(bob)
        with connect(f"{app.ws_url}/v1/sessions/{session}/ws",
                     additional_headers={"Authorization": f"Bearer {BOB}"}) as ws:
            start = time.monotonic()
            ws.send(json.dumps({"type": "append", "text": "w", "generate": {"max_tokens": 2},
                                "request_id": "g"}))
            done = json.loads(ws.recv(timeout=10))
            assert (done["type"], done["finish_reason"], done["request_id"]) == ("done", "cancelled", "g")
            assert IDLE_S <= time.monotonic() - start < IDLE_S + 5
            # Nothing runs and nothing is sent: the server closes the socket after the timeout.
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        bob.delete(f"/v1/sessions/{session}")


def test_idle_openai_stream_is_cancelled(app: LiveApp) -> None:
    with busy_engine(app), http(app, BOB) as bob:
        body = {"model": RANDOM_MODEL_NAME, "messages": [{"role": "user", "content": "q"}],
                "max_tokens": 2, "stream": True}
        with bob.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][5:])["choices"][0]["finish_reason"] == "stop"
