"""SSE and WebSocket streams against the real server: they concatenate to exactly the non-streamed
output, sequence numbers count events, and a WebSocket cancel commits what the client saw."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from phloem.api import Client, Session

pytestmark = pytest.mark.slow  # the session's phloem serve process

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _three_identical_sessions(client: Client) -> list[Session]:
    root = client.sessions.create(messages=[{"role": "system", "content": f"run {uuid.uuid4().hex}"}])
    root.append(messages=[{"role": "user", "content": "hello"}], generate={**GREEDY, "max_tokens": 4})
    return root.fork(3)


def test_sse_and_websocket_equal_the_plain_append(client: Client) -> None:
    plain_s, sse_s, ws_s = _three_identical_sessions(client)
    new = {"messages": [{"role": "user", "content": "Again, with feeling: ¿qué tal? 日本"}]}
    plain = plain_s.append(**new, generate=GREEDY)  # type: ignore[arg-type]
    for session, transport in ((sse_s, "sse"), (ws_s, "websocket")):
        with session.stream(**new, generate=GREEDY, transport=transport) as stream:  # type: ignore[arg-type]
            deltas = list(stream)
        assert stream.result is not None
        assert [t for d in deltas for t in d.token_ids] == plain.output_ids == stream.result.output_ids
        assert "".join(d.text for d in deltas) == plain.text == stream.result.text
        assert [d.sequence_number for d in deltas] == list(range(len(deltas)))
        usage = stream.result.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
        assert stream.result.num_tokens == plain.num_tokens
        # A later twin of the same history may hit what an earlier one computed (a branch
        # checkpoint where their prompts part, or the earlier prompt-end checkpoint).
        assert usage.cached_tokens >= plain.usage.cached_tokens


def test_sse_wire_format(client: Client, server: Any) -> None:
    session = _three_identical_sessions(client)[0]
    body = {"text": " more", "generate": {**GREEDY, "max_tokens": 3}, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/sessions/{session.id}/append", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event:")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data:")]
    assert names == [e["type"] for e in events] == ["delta"] * 3 + ["done"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    assert events[-1]["output_ids"] == [t for e in events[:-1] for t in e["token_ids"]]


def test_websocket_cancel_leaves_the_session_consistent(client: Client) -> None:
    session = _three_identical_sessions(client)[0]
    before = session.refresh().num_tokens
    stream = session.stream(text=" go on", generate={"max_tokens": 4000, "temperature": 0,
                                                     "ignore_eos": True}, transport="websocket")
    seen = []
    for delta in stream:
        seen.append(delta)
        if len(seen) == 3:
            stream.cancel()
    result = stream.result
    assert result is not None and result.finish_reason == "cancelled"
    assert result.output_ids == [t for d in seen for t in d.token_ids], "committed = what was seen"
    assert result.text == "".join(d.text for d in seen)
    last = session.turns()[-1]
    assert (last.index, last.finish_reason, last.num_output_tokens) == (
        result.turn, "cancelled", len(result.output_ids))
    assert session.refresh().num_tokens == result.num_tokens == last.end
    assert before + 2 < result.num_tokens
    after = session.append(text=" next", generate={**GREEDY, "max_tokens": 2})
    assert after.turn == result.turn + 1 and after.usage.prompt_tokens == after.num_tokens - 2
    # The engine kept what the cancelled request computed: all of it but the last sampled token.
    assert after.usage.cached_tokens >= result.num_tokens - 1


def test_websocket_protocol(server: Any, client: Client) -> None:
    session = _three_identical_sessions(client)[0]
    url = f"{server.base_url.replace('http', 'ws', 1)}/v1/sessions/{session.id}/ws"
    with connect(url) as ws:
        ws.send(json.dumps({"type": "cancel", "request_id": "c0"}))
        assert json.loads(ws.recv()) == {"type": "cancelled", "sequence_number": 0, "request_id": "c0"}
        ws.send("{not json")
        error = json.loads(ws.recv())
        assert (error["type"], error["code"], error["sequence_number"]) == ("error", "invalid_request", 1)
        ws.send(json.dumps({"type": "append", "text": "x", "generate": {"max_tokens": 0}}))
        assert json.loads(ws.recv())["code"] == "invalid_request"
        ws.send(json.dumps({"type": "append", "text": " plain", "request_id": "a"}))
        done = json.loads(ws.recv())
        assert (done["type"], done["finish_reason"], done["request_id"]) == ("done", None, "a")
        ws.send(json.dumps({"type": "fork", "n": 2, "request_id": "f"}))
        forked = json.loads(ws.recv())
        assert forked["type"] == "forked" and len(forked["sessions"]) == 2
        assert forked["sessions"][0]["num_tokens"] == done["num_tokens"]
        ws.send(json.dumps({"type": "append", "text": " more", "generate": {"max_tokens": 4000},
                            "request_id": "g"}))
        assert json.loads(ws.recv())["type"] == "delta"
        ws.send(json.dumps({"type": "append", "text": " more", "request_id": "busy"}))
        # Wait for the busy error (deltas of "g" may come first) before deleting: otherwise the
        # delete can win the race and the second append finds no session at all.
        while json.loads(ws.recv()).get("code") != "session_busy":
            pass
        client.sessions.delete(session.id)  # a deleted session ends the socket: 4404
        codes = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                codes.append(json.loads(ws.recv()).get("code"))
        assert codes[-1] == "session_not_found"
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


def test_a_deleted_session_closes_its_idle_socket(server: Any, client: Client) -> None:
    """With nothing running on the socket (its turn finished), the session's deletion still ends
    it: one ``session_not_found`` error, then 4404, within seconds, not at the idle timeout."""
    session = client.sessions.create(text="x")
    url = f"{server.base_url.replace('http', 'ws', 1)}/v1/sessions/{session.id}/ws"
    with connect(url) as ws:
        ws.send(json.dumps({"type": "append", "text": " y", "request_id": "a"}))
        assert json.loads(ws.recv())["type"] == "done"
        client.sessions.delete(session.id)
        error = json.loads(ws.recv(timeout=10))
        assert (error["type"], error["code"]) == ("error", "session_not_found")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


def test_websocket_frame_over_the_body_limit_closes_1009(server: Any, client: Client) -> None:
    session = client.sessions.create(text="x")
    url = f"{server.base_url.replace('http', 'ws', 1)}/v1/sessions/{session.id}/ws"
    with connect(url, max_size=None) as ws:
        ws.send(json.dumps({"type": "append", "text": "y" * (9 * 1024 * 1024)}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    assert session.refresh().num_turns == 1
