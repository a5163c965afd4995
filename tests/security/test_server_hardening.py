"""Item 7, the server process: its data directory, its owner ids and its connections.

- an unwritable data directory makes ``/health`` say ``degraded``, and no answer names a server
  path; an unusable ``--data-dir`` at start is a usage error (exit 2), not a traceback;
- what the server writes is private (files 0600, directories 0700);
- owner ids are a keyed hash of the API key (the server's secret lives in the data directory),
  and sessions stored under the former unkeyed ids are moved to their key at start;
- a second server on the same data directory exits with a clear message;
- connections that never finish a request head are closed, and connections beyond the cap too.
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
from live_servers import ServerProcess
import pytest
from tenants import ALICE, auth, key_args

# The modules of keyed owner ids are imported inside the tests that use them, so that every other
# test of this file also runs (and fails) against a server without them.


@pytest.mark.slow  # a phloem serve process
def test_an_unwritable_data_dir_degrades_health_and_hides_paths(tmp_path: Path, model_dir: Path) -> None:
    server = ServerProcess(tmp_path, key_args("--model", str(model_dir))).start()
    journal = tmp_path / "sessions"
    try:
        with httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=60) as alice:
            sid = alice.post("/v1/sessions", json={"text": "x"}).json()["id"]
            journal.rename(tmp_path / "sessions.moved")
            journal.write_text("not a directory")  # every journal write now fails (even as root)
            failed = alice.post(f"/v1/sessions/{sid}/append", json={"input_ids": [5]})
            assert failed.status_code == 500 and str(tmp_path) not in failed.text, failed.text
            health = httpx.get(f"{server.base_url}/health", timeout=30).json()
            assert health["status"] == "degraded" and str(tmp_path) not in json.dumps(health)
            assert "journal" in health["reason"]
            journal.unlink()
            (tmp_path / "sessions.moved").rename(journal)
            assert alice.post(f"/v1/sessions/{sid}/append", json={"input_ids": [5]}).status_code == 200
            assert httpx.get(f"{server.base_url}/health", timeout=30).json()["status"] == "ok"
    finally:
        server.stop()


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "phloem.cli", "serve", "--port", "0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_an_unusable_data_dir_is_a_usage_error(tmp_path: Path, model_dir: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    done = _serve("--data-dir", str(not_a_dir), "--model", str(model_dir))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "--data-dir" in done.stderr


@pytest.mark.slow  # a phloem serve process
def test_a_second_server_on_one_data_dir_exits(tmp_path: Path, model_dir: Path) -> None:
    first = ServerProcess(tmp_path, ("--model", str(model_dir))).start()
    try:
        second = _serve("--data-dir", str(tmp_path), "--model", str(model_dir))
        assert second.returncode == 2 and "another phloem server" in second.stderr, second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        assert httpx.get(f"{first.base_url}/health", timeout=30).status_code == 200
    finally:
        first.stop()


@pytest.mark.slow  # a phloem serve process
def test_files_are_private_and_owner_ids_are_keyed(tmp_path: Path, model_dir: Path) -> None:
    from phloem.api.server.auth import legacy_owner_id, owner_id
    from phloem.storage import server_secret

    server = ServerProcess(tmp_path, key_args("--model", str(model_dir))).start()
    try:
        with httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=60) as alice:
            sid = alice.post("/v1/sessions", json={"input_ids": list(range(10, 60))}).json()["id"]
            alice.post(f"/v1/sessions/{sid}/append", json={"generate": {"max_tokens": 1}})
            assert alice.post(f"/v1/sessions/{sid}/offload", json={"tier": "disk"}).status_code == 202
            deadline = time.monotonic() + 60
            while not list((tmp_path / "segments").rglob("*.safetensors")):
                assert time.monotonic() < deadline, "the session was not spilled to disk"
                time.sleep(0.1)
    finally:
        server.stop()
    written = [tmp_path / "server.secret", tmp_path / "index.sqlite", *(tmp_path / "sessions").iterdir(),
               *(tmp_path / "segments").rglob("*")]
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    for folder in (tmp_path / "sessions", tmp_path / "segments"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    record = json.loads((tmp_path / "sessions" / f"{sid}.json").read_text())
    assert record["owner"] == owner_id(ALICE, server_secret(tmp_path)) != legacy_owner_id(ALICE)


@pytest.mark.slow  # phloem serve processes
def test_sessions_of_former_owner_ids_move_to_their_key(tmp_path: Path, model_dir: Path) -> None:
    from phloem.api.server.auth import legacy_owner_id, owner_id
    from phloem.storage import server_secret

    server = ServerProcess(tmp_path, key_args("--model", str(model_dir))).start()
    try:
        sid = httpx.post(f"{server.base_url}/v1/sessions", json={"text": "old"}, headers=auth(ALICE),
                         timeout=60).json()["id"]
    finally:
        server.stop()
    path = tmp_path / "sessions" / f"{sid}.json"
    record = json.loads(path.read_text())
    record["owner"] = legacy_owner_id(ALICE)  # as a server before keyed owner ids wrote it
    path.write_text(json.dumps(record))
    server = ServerProcess(tmp_path, key_args("--model", str(model_dir))).start()
    try:
        listed = httpx.get(f"{server.base_url}/v1/sessions", headers=auth(ALICE), timeout=60).json()
        assert [s["id"] for s in listed["sessions"]] == [sid]
    finally:
        server.stop()
    assert json.loads(path.read_text())["owner"] == owner_id(ALICE, server_secret(tmp_path))


@pytest.mark.slow  # a phloem serve process
def test_slow_request_heads_and_excess_connections_are_closed(tmp_path: Path, model_dir: Path) -> None:
    server = ServerProcess(tmp_path, key_args("--model", str(model_dir), "--header-timeout", "1",
                                              "--max-connections", "6")).start()
    try:
        trickler = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        trickler.sendall(b"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        start = time.monotonic()
        closed_after = None
        while time.monotonic() - start < 8:
            try:
                trickler.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.25)
            except OSError:
                closed_after = time.monotonic() - start
                break
        assert closed_after is not None and closed_after < 3, "a trickling request head was not cut off"
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(6)]
        excess = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        assert excess.recv(1) == b"", "a connection beyond --max-connections is closed at once"
        for sock in (*idle, excess, trickler):
            sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    finally:
        server.stop()
