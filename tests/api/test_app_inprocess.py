"""The app in process (Litestar ``TestClient``): admission (503 + Retry-After), idempotency,
WebSocket via ``websocket_connect``, the OpenAPI schema, and the SDK over the test client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from phloem.api import Client

pytestmark = pytest.mark.slow  # an engine and app in process


def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def session(app_client: Any, **body: Any) -> str:
    response = app_client.post("/v1/sessions", json=body or {"text": "hi"})
    assert response.status_code == 201, response.text
    assert response.headers["location"] == f"/v1/sessions/{response.json()['id']}"
    return str(response.json()["id"])


def test_schema_and_health(app_client: Any) -> None:
    assert app_client.get("/health").json()["status"] == "ok"
    schema = app_client.get("/schema/openapi.json").json()
    assert {"/v1/sessions", "/v1/sessions/{session_id}/append", "/v1/chat/completions",
            "/v1/completions", "/v1/models"} <= set(schema["paths"])


def test_overloaded_is_503_with_retry_after(app_client: Any) -> None:
    busy, other = session(app_client), session(app_client)
    with app_client.websocket_connect(f"/v1/sessions/{busy}/ws") as ws:
        ws.send_text(json.dumps({"type": "append", "generate": {"max_tokens": 4000,
                                                                  "ignore_eos": True}}))
        assert ws.receive_json()["type"] == "delta"
        response = app_client.post(f"/v1/sessions/{other}/append",
                                   json={"text": "x", "generate": {"max_tokens": 1}})
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        assert response.json()["code"] == "overloaded"
        chat = app_client.post("/v1/chat/completions", json={
            "model": "phloem-tiny-qwen3.5", "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "overloaded"
        ws.send_text(json.dumps({"type": "cancel", "request_id": "stop"}))
        events = [ws.receive_json()]
        while events[-1]["type"] != "cancelled":
            events.append(ws.receive_json())
        assert [e["type"] for e in events if e["type"] != "delta"] == ["done", "cancelled"]
    done = next(e for e in events if e["type"] == "done")
    assert done["finish_reason"] == "cancelled"
    ok = app_client.post(f"/v1/sessions/{other}/append", json={"text": "x", "generate": {"max_tokens": 1}})
    assert ok.status_code == 200


def test_idempotency_key_replays_and_conflicts(app_client: Any) -> None:
    headers = {"Idempotency-Key": "create-1"}
    first = app_client.post("/v1/sessions", json={"text": "once"}, headers=headers)
    again = app_client.post("/v1/sessions", json={"text": "once"}, headers=headers)
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    other = app_client.post("/v1/sessions", json={"text": "twice"}, headers=headers)
    assert other.status_code == 422 and other.json()["code"] == "idempotency_conflict"

    sid = first.json()["id"]
    body = {"text": " go", "generate": {"max_tokens": 3, "temperature": 0}}
    results = [app_client.post(f"/v1/sessions/{sid}/append", json=body,
                               headers={"Idempotency-Key": "append-1"}) for _ in range(2)]
    assert results[0].json() == results[1].json()
    assert len(app_client.get(f"/v1/sessions/{sid}/turns").json()["turns"]) == 2, "ran once"

    stream_body = {**body, "stream": True}
    streams = [app_client.post(f"/v1/sessions/{sid}/append", json=stream_body,
                               headers={"Idempotency-Key": "append-2"}) for _ in range(2)]
    done = [_sse_events(s.text)[-1] for s in streams]
    assert done[0]["turn"] == done[1]["turn"] == 2 and done[0]["output_ids"] == done[1]["output_ids"]
    replayed = _sse_events(streams[1].text)
    assert [e["type"] for e in replayed] == ["delta", "done"]
    assert replayed[0]["token_ids"] == done[0]["output_ids"]

    deletes = [app_client.delete(f"/v1/sessions/{sid}", headers={"Idempotency-Key": "del-1"})
               for _ in range(2)]
    assert [d.status_code for d in deletes] == [204, 204]
    assert deletes[1].headers["idempotent-replayed"] == "true"


def _sse_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")
            and line[5:].strip()]


def test_sdk_over_the_test_client(app_client: Any) -> None:
    sdk = Client(http_client=app_client)
    created = sdk.sessions.create(messages=[{"role": "system", "content": "Be brief."}],
                                  metadata={"via": "sdk"})
    result = created.append(messages=[{"role": "user", "content": "hi"}],
                            generate={"max_tokens": 2, "temperature": 0})
    assert result.turn == 1 and len(result.output_ids) <= 2
    assert created.update(ttl=5).ttl == 5.0 and created.info.metadata == {"via": "sdk"}
    # Accepted (202) with the status as of acceptance; the move runs in the background.
    assert created.offload().status == "active"
    assert eventually(lambda: created.refresh().status == "host")
    created.prefetch()
    assert eventually(lambda: created.refresh().status == "active")
    assert created.id in {s.id for s in sdk.sessions.list()}
    too_big = app_client.post("/v1/sessions", content=b"x" * (2 << 20),
                              headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["code"] == "payload_too_large"
    created.delete()
