"""``Idempotency-Key`` against the real server (docs/api.md, "Idempotency"): a retried append or
fork answers the first result and never commits twice, also when the retry races the first
request; the same key with another body is 422; errors are not stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # the session's phloem serve process

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def new_session(http: httpx.Client) -> str:
    response = http.post("/v1/sessions", json={"text": "idempotent"})
    assert response.status_code == 201
    return str(response.json()["id"])


def turns(http: httpx.Client, session: str) -> list[dict[str, Any]]:
    return list(http.get(f"/v1/sessions/{session}/turns").json()["turns"])


def test_a_retried_append_answers_the_first_result_and_commits_once(http: httpx.Client) -> None:
    session = new_session(http)
    body = {"text": " once", "generate": {**GREEDY, "temperature": 1.0}}
    headers = {"Idempotency-Key": "append-once"}
    first = http.post(f"/v1/sessions/{session}/append", json=body, headers=headers)
    retry = http.post(f"/v1/sessions/{session}/append", json=body, headers=headers)
    assert first.status_code == retry.status_code == 200
    assert retry.json() == first.json() and retry.headers["idempotent-replayed"] == "true"
    assert len(turns(http, session)) == 2

    changed = http.post(f"/v1/sessions/{session}/append", json={**body, "text": " twice"}, headers=headers)
    assert changed.status_code == 422 and changed.json()["code"] == "idempotency_conflict"
    elsewhere = http.post(f"/v1/sessions/{new_session(http)}/append", json=body, headers=headers)
    assert elsewhere.status_code == 422, "the path is part of the fingerprint"
    assert len(turns(http, session)) == 2


def test_concurrent_retries_run_the_append_once(http: httpx.Client, server: Any) -> None:
    session = new_session(http)
    body = {"text": " race", "generate": {**GREEDY, "max_tokens": 40, "temperature": 1.0}}

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/sessions/{session}/append", json=body, timeout=60,
                          headers={"Idempotency-Key": "append-race"})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(post, range(4)))
    assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
    assert len({r.text for r in responses}) == 1, "every retry got the first result"
    assert sum("idempotent-replayed" in r.headers for r in responses) == 3
    assert len(turns(http, session)) == 2, "one turn, not four"


def test_a_retried_stream_replays_its_done(http: httpx.Client) -> None:
    session = new_session(http)
    body = {"text": " sse", "generate": GREEDY, "stream": True}
    headers = {"Idempotency-Key": "stream-once"}
    first, retry = (http.post(f"/v1/sessions/{session}/append", json=body, headers=headers)
                    for _ in range(2))
    done = [json.loads(line[5:]) for r in (first, retry) for line in r.text.splitlines()
            if line.startswith("data:") and '"done"' in line]
    assert done[0] == {**done[1], "sequence_number": done[0]["sequence_number"]}
    assert len(turns(http, session)) == 2


def test_a_retried_fork_makes_its_children_once(http: httpx.Client) -> None:
    parent = new_session(http)
    headers = {"Idempotency-Key": "fork-once"}
    first = http.post(f"/v1/sessions/{parent}/fork", json={"n": 3}, headers=headers)
    retry = http.post(f"/v1/sessions/{parent}/fork", json={"n": 3}, headers=headers)
    assert first.status_code == retry.status_code == 201 and first.json() == retry.json()
    children = http.get("/v1/sessions", params={"parent_id": parent}).json()["sessions"]
    assert sorted(c["id"] for c in children) == sorted(c["id"] for c in first.json()["sessions"])
    conflict = http.post(f"/v1/sessions/{parent}/fork", json={"n": 2}, headers=headers)
    assert conflict.status_code == 422 and conflict.json()["code"] == "idempotency_conflict"


def test_an_error_is_not_stored(http: httpx.Client) -> None:
    session = new_session(http)
    headers = {"Idempotency-Key": "error-then-ok"}
    body = {"text": " x", "generate": GREEDY}
    gone = http.post("/v1/sessions/sess_doesnotexist/append", json=body, headers=headers)
    assert gone.status_code == 404
    again = http.post("/v1/sessions/sess_doesnotexist/append", json=body, headers=headers)
    assert again.status_code == 404 and "idempotent-replayed" not in again.headers
    ok = http.post(f"/v1/sessions/{session}/append", json=body, headers={"Idempotency-Key": "fresh"})
    assert ok.status_code == 200 and len(turns(http, session)) == 2
