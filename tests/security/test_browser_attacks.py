"""Item 3: a web page cannot drive a key-less loopback server (DNS rebinding, cross-site POSTs),
and the API pages load nothing from a CDN unless asked to (``--docs-ui``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_servers import ServerProcess
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

pytestmark = pytest.mark.slow  # phloem serve processes of its own


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("keyless"),
                           ("--model", str(model_dir), "--allowed-host", "phloem.internal")).start()
    try:
        yield server
    finally:
        server.stop()


def _num_sessions(server: ServerProcess) -> int:
    return len(httpx.get(f"{server.base_url}/v1/sessions", params={"limit": 100}, timeout=30).json()["sessions"])


def test_a_foreign_host_name_is_refused(keyless: ServerProcess) -> None:
    httpx.post(f"{keyless.base_url}/v1/sessions", json={"text": "private notes"}, timeout=30)
    rebound = httpx.get(f"{keyless.base_url}/v1/sessions", headers={"Host": f"attacker.example:{keyless.port}"},
                        timeout=30)
    assert rebound.status_code == 400 and rebound.json()["code"] == "invalid_request"
    assert "sess_" not in rebound.text and "attacker.example" in rebound.json()["detail"]
    for host in (f"localhost:{keyless.port}", f"127.0.0.1:{keyless.port}", f"[::1]:{keyless.port}",
                 "localhost", f"phloem.internal:{keyless.port}"):
        answer = httpx.get(f"{keyless.base_url}/v1/sessions", headers={"Host": host}, timeout=30)
        assert answer.status_code == 200, (host, answer.text)


def test_cross_site_requests_are_refused(keyless: ServerProcess) -> None:
    before = _num_sessions(keyless)
    url = f"{keyless.base_url}/v1/sessions"
    for kind, body in (("text/plain", b'{"text": "x"}'), ("application/x-www-form-urlencoded", b"text=x"),
                       ("multipart/form-data; boundary=b", b"--b--")):
        refused = httpx.post(url, content=body, headers={"Content-Type": kind}, timeout=30)
        assert refused.status_code == 415 and refused.json()["code"] == "unsupported_media_type", kind
    no_type = httpx.post(url, content=b'{"text": "x"}', headers={"Content-Type": ""}, timeout=30)
    assert no_type.status_code == 415
    page = httpx.post(url, json={"text": "x"}, headers={"Origin": "https://attacker.example"}, timeout=30)
    assert page.status_code == 400 and "Origin" in page.json()["detail"]
    assert _num_sessions(keyless) == before, "nothing was created"
    same_site = httpx.post(url, json={"text": "x"}, headers={"Origin": f"http://localhost:{keyless.port}"},
                           timeout=30)
    assert same_site.status_code == 201
    sid = same_site.json()["id"]
    append = httpx.post(f"{url}/{sid}/append", content=b'{"text": "y"}', headers={"Content-Type": "text/plain"},
                        timeout=30)
    assert append.status_code == 415
    with pytest.raises(InvalidStatus) as refused_ws:
        with connect(f"ws://127.0.0.1:{keyless.port}/v1/sessions/{sid}/ws", origin="https://attacker.example",
                     open_timeout=10):
            pass
    assert refused_ws.value.response.status_code == 403


def test_the_api_pages_are_off_unless_asked_for(keyless: ServerProcess, model_dir: Path, tmp_path: Path) -> None:
    assert httpx.get(f"{keyless.base_url}/schema/openapi.json", timeout=30).status_code == 200
    for page in ("/schema/swagger", "/schema/redoc", "/schema/elements", "/schema/rapidoc"):
        assert httpx.get(f"{keyless.base_url}{page}", timeout=30).status_code == 404, page
    assert "<script" not in httpx.get(f"{keyless.base_url}/schema", timeout=30).text
    docs = ServerProcess(tmp_path, ("--model", str(model_dir), "--docs-ui")).start()
    try:
        assert "<script" in httpx.get(f"{docs.base_url}/schema/swagger", timeout=30).text
    finally:
        docs.stop()
