"""Hostile session ids and client strings against the real server, sent byte for byte (no client
normalises them): every route answers 404 or 400, and nothing is created on disk."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

pytestmark = pytest.mark.slow  # the session's phloem serve process

HOSTILE = ["../x", "..%2Fx", "%2e%2e", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "%00", "a%00b", "x" * 10240,
           "sess_%2F..%2F..", "%252e%252e", "~root", "C:%5Cwindows", "%ff%fe", "sess_x%0d%0aX-Evil:%201"]
ROUTES = [("GET", "{id}", None), ("DELETE", "{id}", None), ("PATCH", "{id}", {"ttl": 1}),
          ("POST", "{id}/append", {"text": "x", "generate": {"max_tokens": 1}}),
          ("POST", "{id}/fork", {"n": 1}), ("GET", "{id}/turns", None),
          ("POST", "{id}/offload", {"tier": "disk"}), ("POST", "{id}/prefetch", None)]


def raw_request(base_url: str, method: str, target: str, body: Any = None,
                extra: str = "") -> tuple[int, bytes]:
    """One HTTP/1.1 request with ``target`` (and ``extra`` header lines) exactly as given; the
    status and the body."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = b"" if body is None else json.dumps(body).encode()
    head = (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + payload)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.mark.parametrize("hostile", HOSTILE, ids=[h[:24] for h in HOSTILE])
def test_hostile_ids_are_refused_and_touch_no_file(server: Any, hostile: str) -> None:
    root: Path = server.data_dir
    before, around = files(root), set(root.parent.iterdir())
    for method, path, body in ROUTES:
        status, content = raw_request(server.base_url, method, f"/v1/sessions/{path.format(id=hostile)}", body)
        assert status in (400, 404), (method, path, status, content[:200])
        if status == 404 and content:
            problem = json.loads(content)
            assert problem["code"] in ("session_not_found", "not_found")
            assert len(problem["detail"]) < 300, "a long id is not echoed back whole"
    try:
        with connect(f"{server.base_url.replace('http', 'ws', 1)}/v1/sessions/{hostile}/ws",
                     open_timeout=3) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    assert json.loads(ws.recv(timeout=10))["code"] == "session_not_found"
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
    except InvalidStatus as refused:
        # No route matches (e.g. `../x/ws`): the ASGI server refuses the handshake with 403. A
        # request line over 8 KiB: uvicorn's WebSocket server (websockets 17) answers 414.
        allowed = (400, 403, 404, 414) if len(hostile) > 8000 else (400, 403, 404)
        assert refused.response.status_code in allowed
    except TimeoutError:
        # Older websockets servers refuse a request line over 8 KiB without an answer.
        assert len(hostile) > 8000
    new = files(root) - before
    fragments = ("..", "\x00", "passwd", "windows", "root", "xxxxxxxx", "Evil")
    assert not [p for p in new if any(f in str(p) for f in fragments)], new
    assert set(root.parent.iterdir()) == around, "nothing was written next to the data dir"


def test_hostile_query_strings_and_idempotency_keys(server: Any) -> None:
    root: Path = server.data_dir
    before = files(root)
    for query in ("after=..%2F..%2Fx", "parent_id=%00", "parent_id=..%2F..", "after=" + "z" * 5000,
                  "limit=-1", "limit=abc", "all=maybe"):
        status, content = raw_request(server.base_url, "GET", f"/v1/sessions?{query}")
        assert status in (200, 400), (query, status, content[:200])
        if query.startswith("parent_id"):
            assert status == 200 and json.loads(content)["sessions"] == []
    for key, expected in (("../../x", 201), ("a" * 300, 400), ("\x7f", 400), ("%00", 201)):
        status, content = raw_request(server.base_url, "POST", "/v1/sessions", {"text": "k"},
                                      f"Idempotency-Key: {key}\r\n")
        assert status == expected, (key, content[:200])
        if status == 201:
            raw_request(server.base_url, "DELETE", f"/v1/sessions/{json.loads(content)['id']}")
    new = files(root) - before
    assert not [p for p in new if ".." in str(p) or "%" in str(p)], new


def test_session_ids_are_random_opaque_and_sorted(server: Any) -> None:
    """``sess_`` + 10 characters of milliseconds + 26 of 128 random bits (Crockford base32)."""
    ids = []
    for _ in range(16):
        status, content = raw_request(server.base_url, "POST", "/v1/sessions", {})
        assert status == 201
        ids.append(json.loads(content)["id"])
    assert all(re.fullmatch(r"sess_[0-9A-HJKMNP-TV-Z]{36}", sid) for sid in ids), ids
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    tails = [sid[-26:] for sid in ids]
    # Not a counter: consecutive random parts differ almost everywhere.
    assert min(sum(a != b for a, b in zip(x, y)) for x, y in zip(tails, tails[1:])) >= 16
    for sid in ids:
        raw_request(server.base_url, "DELETE", f"/v1/sessions/{sid}")
