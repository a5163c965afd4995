"""Structured logs and request ids of a real ``phloem serve`` process.

With ``--log-format json`` every line the server writes is one JSON object: one ``http.request``
line per request (method, path, route, status, duration, request id, owner) and one line per
session transition, carrying the id of the request that caused it. Every response has an
``X-Request-Id`` (the client's when valid, else a fresh one), and error bodies repeat it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_servers import ServerProcess

from phloem.api import Client, SessionNotFound
from phloem.api.server.auth import owner_id
from phloem.storage import server_secret

pytestmark = pytest.mark.slow  # phloem serve processes of its own

KEY = "logs-test-key-0123456789abcdef"
GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


def lines_with(records: list[dict[str, Any]], request_id: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("request_id") == request_id]


def test_json_logs_one_line_per_request_and_per_transition(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, args=("--api-key", KEY, "--log-format", "json")).start()
    auth = {"Authorization": f"Bearer {KEY}"}
    rng = random.Random(5)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60, headers=auth) as http:
            created = http.post("/v1/sessions", json={"input_ids": [rng.randrange(3, 1900) for _ in range(20)]},
                                headers={"X-Request-Id": "client-abc.1"})
            assert created.status_code == 201 and created.headers["x-request-id"] == "client-abc.1"
            sid = created.json()["id"]
            appended = http.post(f"/v1/sessions/{sid}/append", json={"generate": GREEDY},
                                 headers={"X-Request-Id": "x" * 129})  # too long: replaced
            append_id = appended.headers["x-request-id"]
            assert append_id.startswith("req_") and len(append_id) == 36
            usage = appended.json()["usage"]
            fork_id = http.post(f"/v1/sessions/{sid}/fork", json={"n": 2},
                                headers={"X-Request-Id": "bad id\x01"}).headers["x-request-id"]
            assert fork_id.startswith("req_")
            missing = http.get("/v1/sessions/sess_nope", headers={"X-Request-Id": "trace:42"})
            assert (missing.status_code, missing.headers["x-request-id"]) == (404, "trace:42")
            assert missing.json()["request_id"] == "trace:42"
            refused = httpx.get(f"{server.base_url}/v1/sessions", timeout=30)
            assert refused.status_code == 401
            assert refused.json()["request_id"] == refused.headers["x-request-id"]
            deleted = http.delete(f"/v1/sessions/{sid}", headers={"X-Request-Id": "del-1"})
            assert deleted.status_code == 204
            # Longer than the model's window: refused, and tokenizing it logs no library warning.
            too_long = http.post("/v1/sessions", json={"text": "hello world " * 6000})
            assert too_long.json()["code"] == "context_length_exceeded"
    finally:
        server.stop()

    assert server.log is not None
    text = server.log.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert len(records) == len(text.splitlines()), "every line is one JSON object"
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)

    (create_req,) = [r for r in lines_with(records, "client-abc.1") if r["msg"] == "http.request"]
    assert {k: create_req[k] for k in ("method", "path", "route", "status", "owner")} == {
        "method": "POST", "path": "/v1/sessions", "route": "/v1/sessions", "status": 201,
        "owner": owner_id(KEY, server_secret(tmp_path))}
    assert create_req["duration_ms"] > 0 and create_req["client"].startswith("127.0.0.1:")
    (created_event,) = [r for r in lines_with(records, "client-abc.1") if r["msg"] == "session.created"]
    assert (created_event["session_id"], created_event["num_tokens"]) == (sid, 20)

    (finished,) = [r for r in lines_with(records, append_id) if r["msg"] == "generation.finished"]
    assert (finished["session_id"], finished["turn"], finished["finish_reason"]) == (sid, 1, "length")
    assert {k: finished[k] for k in usage} == usage == {"prompt_tokens": 20, "cached_tokens": 0,
                                                        "completion_tokens": 3}
    (forked,) = [r for r in lines_with(records, fork_id) if r["msg"] == "session.forked"]
    assert forked["session_id"] == sid and len(forked["children"]) == 2 and forked["at_turn"] == 1
    (missing_req,) = lines_with(records, "trace:42")
    assert (missing_req["route"], missing_req["status"]) == ("/v1/sessions/{session_id}", 404)
    unauthenticated = [r for r in records if r["msg"] == "http.request" and r["status"] == 401]
    assert len(unauthenticated) == 1 and "owner" not in unauthenticated[0]
    assert {r["msg"] for r in lines_with(records, "del-1")} == {"session.deleted", "http.request"}
    assert any(r["logger"] == "uvicorn" for r in records), "uvicorn's own lines are JSON too"
    assert not [r for r in records if r["logger"] == "uvicorn.error"], "uvicorn's INFO lines are no errors"
    assert "Token indices sequence length" not in text
    (ready,) = [r for r in records if r["msg"] == "startup.ready"]
    assert ready["url"] == server.base_url and ready["seconds"] >= ready["model"] > 0
    assert {r["phase"] for r in records if r["msg"] == "startup.phase"} >= {"model", "tokenizer", "sessions", "http"}


def log_containing(path: Path, *needles: str) -> str:
    """The log once it holds every needle (a request's line is written after its last byte)."""
    deadline = time.monotonic() + 10
    while not all(n in (text := path.read_text()) for n in needles):
        assert time.monotonic() < deadline, f"not logged: {needles}"
        time.sleep(0.05)
    return text


def test_text_logs_and_request_ids_on_the_shared_server(server: Any, client: Client) -> None:
    with pytest.raises(SessionNotFound) as info:
        client.sessions.get("sess_missing")
    assert info.value.request_id is not None and info.value.request_id.startswith("req_")

    response = httpx.get(f"{server.base_url}/v1/models", headers={"X-Request-Id": "text-log-check"}, timeout=30)
    assert response.headers["x-request-id"] == "text-log-check"
    log_containing(server.log,
                   f"[{info.value.request_id}] http.request method=GET path=/v1/sessions/sess_missing",
                   "[text-log-check] http.request method=GET path=/v1/models route=/v1/models status=200")

    # Closed at the end: a client left to the garbage collector leaks its pooled connection, an
    # unraisable ResourceWarning that fails the whole pytest run at exit.
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as stock, \
            pytest.raises(openai.BadRequestError) as error:
        stock.completions.create(model="phloem-tiny-qwen3.5", prompt=[], max_tokens=1)
    assert error.value.request_id is not None and error.value.request_id.startswith("req_")
