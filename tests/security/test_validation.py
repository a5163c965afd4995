"""Item 7, request validation: every malformed request is a clear one-line 400, never a 500, a
traceback in the log, or a detail that names an internal parameter."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from tenants import ALICE, BOB, Tenants, auth

pytestmark = pytest.mark.slow  # the suite's phloem serve process (`tenants`)



def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _detail(response: httpx.Response) -> str:
    body = response.json()
    return str(body.get("detail") or body["error"]["message"])


@pytest.mark.parametrize("where", ["metadata", "tools"])
def test_deeply_nested_json_is_a_400_and_one_log_line(tenants: Tenants, where: str) -> None:
    assert tenants.server.log is not None
    before = tenants.server.log.read_text()
    if where == "metadata":
        body = '{"text": "x", "metadata": ' + _nested(1200) + "}"
    else:
        body = ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                '"function": {"name": "f", "parameters": ' + _nested(1200) + "}}]}")
    response = tenants.alice.post("/v1/sessions", content=body.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["code"] == "invalid_request"
    assert "nested too deeply" in _detail(response)
    new_lines = tenants.server.log.read_text()[len(before):]
    assert "Traceback" not in new_lines and "RecursionError" not in new_lines.replace("nested too deeply", "")


def test_openai_sampling_bounds_match_the_native_api(tenants: Tenants) -> None:
    alice = tenants.alice
    vocab = json.loads((tenants.model_dir / "config.json").read_text())["vocab_size"]
    model = alice.get("/v1/models").json()["data"][0]["id"]
    for top_k in (0, -5):
        refused = alice.post("/v1/completions", json={"model": model, "prompt": "hi", "top_k": top_k})
        assert refused.status_code == 400 and "top_k" in _detail(refused), top_k
        refused = alice.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "top_k": top_k})
        assert refused.status_code == 400, top_k
    refused = alice.post("/v1/completions", json={"model": model, "prompt": "hi", "stop_token_ids": [vocab]})
    assert refused.status_code == 400 and "stop_token_ids" in _detail(refused)
    sid = alice.post("/v1/sessions", json={"text": "x"}).json()["id"]
    native = alice.post(f"/v1/sessions/{sid}/append", json={"generate": {"stop_token_ids": [vocab + 5]}})
    assert native.status_code == 400 and "stop_token_ids" in _detail(native)
    ok = alice.post("/v1/completions", json={"model": model, "prompt": "hi", "top_k": 1, "max_tokens": 1,
                                             "stop_token_ids": [vocab - 1]})
    assert ok.status_code == 200


def test_malformed_bodies_and_queries_get_clear_messages(tenants: Tenants) -> None:
    alice = tenants.alice
    # An empty body is {} where that is valid (create: an empty session); where a body is
    # required it says so, not "'data'".
    empty = alice.post("/v1/chat/completions", content=b"", headers={"Content-Type": "application/json"})
    assert empty.status_code == 400 and "empty body" in empty.text and "'data'" not in empty.text
    surrogate = alice.post("/v1/sessions", content=b'{"text": "\\ud800"}', headers={"Content-Type": "application/json"})
    assert surrogate.status_code == 400 and "surrogate" in _detail(surrogate)
    listing = alice.get("/v1/sessions", params={"all": "maybe"})
    assert listing.status_code == 400 and "all_keys" not in _detail(listing) and "all:" in _detail(listing)
    ttl = alice.post("/v1/sessions", json={"text": "x", "ttl": 86_401})
    assert ttl.status_code == 400 and "ttl" in _detail(ttl)


def test_two_authorization_headers_are_refused(tenants: Tenants) -> None:
    host, port = tenants.server.base_url.removeprefix("http://").split(":")
    head = (f"GET /v1/sessions HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
            f"Authorization: Bearer {ALICE}\r\nAuthorization: Bearer {BOB}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.split(b"\r\n", 1)[0].split()[1] == b"400", data[:300]
    assert b"Authorization" in data
    # Either key alone still works.
    assert httpx.get(f"{tenants.server.base_url}/v1/sessions", headers=auth(BOB), timeout=30).status_code == 200
