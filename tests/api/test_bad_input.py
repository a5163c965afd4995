"""Bad input against the real server: each gets its documented status and problem+json ``code``,
and the server keeps serving afterwards (``/health`` and a normal append)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from phloem.api.schemas import PROBLEM_CONTENT_TYPE

pytestmark = pytest.mark.slow  # the session's phloem serve process


@pytest.fixture
def http(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def new_session(http: httpx.Client, **body: Any) -> str:
    response = http.post("/v1/sessions", json=body or {"text": "hello"})
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    session = new_session(http)
    response = http.post(f"/v1/sessions/{session}/append",
                         json={"text": " ok", "generate": {"max_tokens": 2, "temperature": 0}})
    assert response.status_code == 200, response.text


def expect(response: httpx.Response, status: int, code: str, detail: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_CONTENT_TYPE)
    problem = response.json()
    assert problem["code"] == code and problem["status"] == status
    assert problem["type"] == f"urn:phloem:error:{code}"
    assert detail in problem["detail"], problem["detail"]


def _post(path: str, body: Any, **kw: Any) -> Callable[[httpx.Client, str], httpx.Response]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.get("headers", {})}
    return lambda http, sid: http.post(path.format(sid=sid), content=content, headers=headers)


CASES = [
    ("unknown field", _post("/v1/sessions", {"metdata": {}}), 400, "invalid_request",
     "unknown field `metdata`"),
    ("wrong type", _post("/v1/sessions/{sid}/append", {"text": "x", "generate": {"max_tokens": "3"}}),
     400, "invalid_request", "$.generate.max_tokens"),
    ("out of bounds", _post("/v1/sessions/{sid}/append", {"text": "x", "generate": {"temperature": 3}}),
     400, "invalid_request", "<= 2.0"),
    ("two inputs", _post("/v1/sessions/{sid}/append", {"text": "x", "input_ids": [1]}), 400,
     "invalid_request", "at most one of"),
    ("stream without generate", _post("/v1/sessions/{sid}/append", {"text": "x", "stream": True}),
     400, "invalid_request", "needs `generate`"),
    ("token id beyond the vocabulary", _post("/v1/sessions/{sid}/append", {"input_ids": [10**6]}),
     400, "invalid_request", "token ids"),
    ("context overflow", _post("/v1/sessions/{sid}/append",
                               {"input_ids": [5] * 9000, "generate": {"max_tokens": 1}}),
     400, "context_length_exceeded", "context window"),
    ("fork past the last turn", _post("/v1/sessions/{sid}/fork", {"at_turn": 5}), 400,
     "invalid_request", "at_turn"),
    ("unknown session", _post("/v1/sessions/sess_nope/append", {"text": "x"}), 404,
     "session_not_found", ""),
    ("not JSON", _post("/v1/sessions", b"{not json"), 400, "invalid_request", "malformed"),
    ("not UTF-8", _post("/v1/sessions", b'{"text": "\xff\xfe\xfd"}'), 400, "invalid_request", ""),
    ("10 MB body", _post("/v1/sessions", b'{"text": "' + b"x" * (10 * 1024 * 1024) + b'"}'), 413,
     "payload_too_large", ""),
    ("bad idempotency key", _post("/v1/sessions", {}, headers={"Idempotency-Key": "a b"}), 400,
     "invalid_request", "Idempotency-Key"),
    ("bad query parameter", lambda http, sid: http.get("/v1/sessions", params={"limit": 0}), 400,
     "invalid_request", "`limit`"),
    ("unknown route", lambda http, sid: http.get("/v1/nothing"), 404, "not_found", ""),
    ("wrong method", lambda http, sid: http.put("/v1/sessions"), 405, "method_not_allowed", ""),
]


@pytest.mark.parametrize(("send", "status", "code", "detail"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_the_server_keeps_serving(
        http: httpx.Client, send: Callable[[httpx.Client, str], httpx.Response], status: int,
        code: str, detail: str) -> None:
    session = new_session(http)
    expect(send(http, session), status, code, detail)
    turns = http.get(f"/v1/sessions/{session}/turns").json()["turns"]
    assert len(turns) == 1, "an error commits nothing"
    still_serving(http)


def test_append_while_generating_is_busy(http: httpx.Client) -> None:
    session = new_session(http)
    body = {"text": " long", "generate": {"max_tokens": 4000, "ignore_eos": True}, "stream": True}
    with http.stream("POST", f"/v1/sessions/{session}/append", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        expect(http.post(f"/v1/sessions/{session}/append", json={"text": "x"}), 409, "session_busy")
        expect(http.post(f"/v1/sessions/{session}/offload"), 409, "session_busy")
        fork = http.post(f"/v1/sessions/{session}/fork", json={"n": 1})
        assert fork.status_code == 201, "forks run while the parent generates"
    # Closing the stream cancelled the generation; what it generated until then is committed.
    deadline = time.monotonic() + 10
    while len(turns := http.get(f"/v1/sessions/{session}/turns").json()["turns"]) < 2:
        assert time.monotonic() < deadline, "the cancelled turn was never committed"
        time.sleep(0.05)
    assert turns[1]["finish_reason"] == "cancelled" and turns[1]["num_output_tokens"] >= 1
    still_serving(http)


def test_fork_of_a_deleted_session(http: httpx.Client) -> None:
    session = new_session(http)
    assert http.delete(f"/v1/sessions/{session}").status_code == 204
    expect(http.post(f"/v1/sessions/{session}/fork", json={"n": 2}), 404, "session_not_found")
    expect(http.get(f"/v1/sessions/{session}"), 404, "session_not_found")
    expect(http.delete(f"/v1/sessions/{session}"), 404, "session_not_found")
    still_serving(http)


def test_an_empty_body_is_the_empty_object(http: httpx.Client) -> None:
    """No body (or ``null``) on create, fork and PATCH is ``{}``, which is valid for each; on append
    ``{}`` names what is missing; on the OpenAI routes the body is required and says so."""
    created = http.post("/v1/sessions")
    assert created.status_code == 201 and created.json()["num_tokens"] == 0, created.text
    session = created.json()["id"]
    assert http.post("/v1/sessions", content=b"null",
                     headers={"content-type": "application/json"}).status_code == 201
    assert http.patch(f"/v1/sessions/{session}").status_code == 200
    forked = http.post(f"/v1/sessions/{new_session(http)}/fork")
    assert forked.status_code == 201 and len(forked.json()["sessions"]) == 1, forked.text
    expect(http.post(f"/v1/sessions/{session}/append"), 400, "invalid_request",
           "expected one of `input_ids`, `messages`, `text`, or `generate`")
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = http.post(path)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == "body: expected a JSON object, got an empty body"
    still_serving(http)


ENDS_EARLY = "it ends early, or holds an invalid escape such as an unpaired UTF-16 surrogate (\\ud800)"


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"text": "x"', ENDS_EARLY), (b"[1", ENDS_EARLY),
    (b"{bad", "object keys must be strings at byte 1"), (b'{"text": "x"} x', "trailing characters at byte 15"),
], ids=["truncated-object", "truncated-array", "bad-key", "trailing"])
def test_malformed_json_has_one_message_on_every_route(http: httpx.Client, body: bytes, reason: str) -> None:
    session = new_session(http)
    expected = f"body: expected a JSON object, got malformed JSON: {reason}"
    headers = {"content-type": "application/json"}
    for path in ("/v1/sessions", f"/v1/sessions/{session}/append", f"/v1/sessions/{session}/fork"):
        expect(http.post(path, content=body, headers=headers), 400, "invalid_request", expected)
        assert http.post(path, content=body, headers=headers).json()["detail"] == expected
    for path in ("/v1/chat/completions", "/v1/completions"):
        response = http.post(path, content=body, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["message"] == expected


def test_forking_a_session_without_turns_at_a_turn_says_it_has_none(http: httpx.Client) -> None:
    session = http.post("/v1/sessions").json()["id"]
    response = http.post(f"/v1/sessions/{session}/fork", json={"at_turn": 0})
    expect(response, 400, "invalid_request", "it has none yet: leave at_turn out")
    assert "-1" not in response.json()["detail"]
