"""API keys against a real ``phloem serve`` with keys from a file and a flag: 401s, tenancy (a
session of another key does not exist on any endpoint and is left unchanged), the admin listing,
idempotency keys scoped per API key, and no secret in the server's log or data directory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_servers import ServerProcess
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from phloem.runtime import ensure_default_model

pytestmark = pytest.mark.slow  # phloem serve processes of its own

ALICE = "alice-key-from-the-file-0123"
BOB = "bob-key-from-the-flag-456789"
ADMIN = "root-key-admin-abcdefghijkl"
WRONG = "mallory-guessed-key-000000"
GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("keyed")
    keys = folder / "keys.txt"
    keys.write_text(f"# the keys of this test\n{ALICE}\n\n  {ADMIN}:admin\n")
    model = ensure_default_model(data_dir)
    server = ServerProcess(folder, ["--model", str(model), "--api-keys-file", str(keys),
                                    "--api-key", BOB])
    server.start()
    yield server
    server.stop()


def as_key(server: ServerProcess, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.Client(base_url=server.base_url, timeout=30, headers=headers)


def expect(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["code"] == code, body
    return body


def ws_events(server: ServerProcess, path: str, key: str | None) -> tuple[list[dict[str, Any]], int]:
    """Open a socket, read until the server closes it; the events and the close code."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    url = server.base_url.replace("http", "ws", 1) + path
    events = []
    with connect(url, additional_headers=headers) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                events.append(json.loads(ws.recv(timeout=10)))
    assert closed.value.rcvd is not None
    return events, closed.value.rcvd.code


def test_requests_without_a_valid_key_are_401(keyed: ServerProcess) -> None:
    for key in (None, WRONG):
        with as_key(keyed, key) as client:
            response = client.get("/v1/sessions")
            expect(response, 401, "unauthorized")
            assert response.headers["www-authenticate"] == "Bearer"
            chat = client.post("/v1/chat/completions", json={"model": "x", "messages": []})
            assert chat.status_code == 401 and chat.json()["error"]["code"] == "unauthorized"
            assert client.get("/v1/models").status_code == 401
            assert client.get("/health").status_code == 200, "health stays public"
            assert client.get("/schema/openapi.json").status_code == 200
        events, code = ws_events(keyed, "/v1/sessions/sess_x/ws", key)
        assert [e["code"] for e in events] == ["unauthorized"] and code == 4401
    basic = httpx.get(f"{keyed.base_url}/v1/sessions", headers={"Authorization": f"Basic {ALICE}"})
    expect(basic, 401, "unauthorized")
    for key in (ALICE, BOB, ADMIN):
        with as_key(keyed, key) as client:
            assert client.get("/v1/sessions").status_code == 200


def test_a_foreign_session_does_not_exist_and_is_left_unchanged(keyed: ServerProcess) -> None:
    with as_key(keyed, ALICE) as alice, as_key(keyed, BOB) as bob:
        sid = alice.post("/v1/sessions", json={"text": "alice's", "metadata": {"who": "alice"}}).json()["id"]
        assert alice.post(f"/v1/sessions/{sid}/append", json={"text": " hi", "generate": GREEDY}).status_code == 200
        child = alice.post(f"/v1/sessions/{sid}/fork", json={"n": 1}).json()["sessions"][0]["id"]
        before = (alice.get(f"/v1/sessions/{sid}").json(),
                  alice.get(f"/v1/sessions/{sid}/turns", params={"include_tokens": True}).json())
        unknown = "sess_" + "0" * 36

        attempts = {
            "get": lambda s: bob.get(f"/v1/sessions/{s}"),
            "patch": lambda s: bob.patch(f"/v1/sessions/{s}", json={"metadata": {"who": "bob"}, "ttl": 1}),
            "delete": lambda s: bob.delete(f"/v1/sessions/{s}"),
            "append": lambda s: bob.post(f"/v1/sessions/{s}/append", json={"text": " x"}),
            "generate": lambda s: bob.post(f"/v1/sessions/{s}/append",
                                           json={"text": " x", "generate": GREEDY, "stream": True}),
            "fork": lambda s: bob.post(f"/v1/sessions/{s}/fork", json={"n": 2}),
            "turns": lambda s: bob.get(f"/v1/sessions/{s}/turns"),
            "offload": lambda s: bob.post(f"/v1/sessions/{s}/offload", json={"tier": "disk"}),
            "prefetch": lambda s: bob.post(f"/v1/sessions/{s}/prefetch"),
        }
        for name, attempt in attempts.items():
            foreign, missing = attempt(sid), attempt(unknown)
            body = expect(foreign, 404, "session_not_found")
            # Indistinguishable from an id that never existed (but for each answer's own request id).
            assert body == {**missing.json(), "detail": missing.json()["detail"].replace(unknown, sid),
                            "request_id": foreign.headers["x-request-id"]}, name
        events, code = ws_events(keyed, f"/v1/sessions/{sid}/ws", BOB)
        assert [e["code"] for e in events] == ["session_not_found"] and code == 4404
        assert bob.get("/v1/sessions").json()["sessions"] == []
        assert bob.get("/v1/sessions", params={"parent_id": sid}).json()["sessions"] == []
        assert [s["id"] for s in alice.get("/v1/sessions", params={"parent_id": sid}).json()["sessions"]] == [child]

        after = (alice.get(f"/v1/sessions/{sid}").json(),
                 alice.get(f"/v1/sessions/{sid}/turns", params={"include_tokens": True}).json())
        assert after == before, "another key changed nothing"
        for session in (sid, child):
            assert alice.delete(f"/v1/sessions/{session}").status_code == 204


def test_admin_lists_every_key_and_others_may_not(keyed: ServerProcess) -> None:
    with as_key(keyed, ALICE) as alice, as_key(keyed, BOB) as bob, as_key(keyed, ADMIN) as admin:
        ids = {alice.post("/v1/sessions", json={}).json()["id"], bob.post("/v1/sessions", json={}).json()["id"]}
        expect(alice.get("/v1/sessions", params={"all": True}), 403, "forbidden")
        assert admin.get("/v1/sessions").json()["sessions"] == [], "without all: its own only"
        listed = admin.get("/v1/sessions", params={"all": True, "limit": 1}).json()
        assert listed["has_more"] and listed["sessions"][0]["id"] == max(ids), "newest first"
        everything = admin.get("/v1/sessions", params={"all": True}).json()["sessions"]
        assert ids <= {s["id"] for s in everything}
        # Listing is all an admin key may do with another key's sessions.
        expect(admin.get(f"/v1/sessions/{max(ids)}"), 404, "session_not_found")
        for client, sid in ((alice, min(ids)), (bob, max(ids))):
            client.delete(f"/v1/sessions/{sid}")


def test_idempotency_keys_are_scoped_per_api_key(keyed: ServerProcess) -> None:
    headers = {"Idempotency-Key": "same-key-for-both"}
    with as_key(keyed, ALICE) as alice, as_key(keyed, BOB) as bob:
        first = alice.post("/v1/sessions", json={"text": "a"}, headers=headers)
        other = bob.post("/v1/sessions", json={"text": "b"}, headers=headers)
        assert first.status_code == other.status_code == 201
        assert "idempotent-replayed" not in other.headers and first.json()["id"] != other.json()["id"]
        alice.delete(f"/v1/sessions/{first.json()['id']}")
        bob.delete(f"/v1/sessions/{other.json()['id']}")


def test_no_secret_in_the_log_or_on_disk(keyed: ServerProcess) -> None:
    assert keyed.log is not None
    log = keyed.log.read_text()
    assert "auth: 3 API key(s) (1 admin)" in log
    assert "method=POST path=/v1/sessions" in log, "requests are logged: the check below means something"
    for path in [keyed.log, *keyed.data_dir.rglob("*")]:
        if path.is_file() and path.name != "keys.txt":
            data = path.read_bytes()
            for secret in (ALICE, BOB, ADMIN, WRONG):
                assert secret.encode() not in data, f"{secret} found in {path}"


def test_a_server_without_keys_says_so(server: Any) -> None:
    assert "auth: no API keys" in server.log.read_text()
