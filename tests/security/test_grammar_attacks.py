"""Grammar compilation cannot take the server down (issue 47): a real ``phloem serve`` with two
keys, the built-in model, CPU.

Alice sends a 100,000-value enum (refused at once), then 8 large-but-allowed schemas at once from
clients that hang up after about a second; meanwhile Bob's Responses call, native append and
chat stay fast, and afterwards the server's memory is back near where it started and the
compiled-grammar cache shows in ``/metrics``.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from live_servers import ServerProcess
from tenants import ADMIN, ALICE, BOB, auth, key_args

pytestmark = pytest.mark.slow

SHORT = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("grammar-attacks")
    process = ServerProcess(data_dir, key_args("--model", str(model_dir))).start()
    try:
        yield process
    finally:
        process.stop()


def chat_with_schema(schema: dict, **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}, **extra}


def large_allowed_schema(seed: int) -> dict:
    """An enum just inside the limits: 4,000 random 6-letter values (32 KB of literals)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(4000)]
    return {"type": "object", "properties": {"pick": {"enum": words}}, "required": ["pick"]}


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_grammar_attacks_leave_another_tenant_and_the_server_unharmed(server: ServerProcess) -> None:
    alice = httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=60)
    bob = httpx.Client(base_url=server.base_url, headers=auth(BOB), timeout=60)
    admin = httpx.Client(base_url=server.base_url, headers=auth(ADMIN), timeout=60)
    model = bob.get("/v1/models").json()["data"][0]["id"]
    session = bob.post("/v1/sessions", json={"messages": [{"role": "user", "content": "hello"}]}).json()["id"]

    def responses() -> httpx.Response:
        return bob.post("/v1/responses", json={"model": model, "input": "Say hi.", "max_output_tokens": 4})

    def append() -> httpx.Response:
        return bob.post(f"/v1/sessions/{session}/append", json={"text": " more", "generate": SHORT})

    def chat() -> httpx.Response:
        return bob.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], **SHORT})

    bob_calls: list[Callable[[], httpx.Response]] = [responses, append, chat]
    small = chat_with_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert alice.post("/v1/chat/completions", json={**small, "model": model}).status_code == 200  # loads xgrammar
    for call in bob_calls * 2:
        assert call().status_code == 200
    start_rss = server.rss_kib()

    # A 100,000-value enum: a 400 naming the limit, in well under a second.
    huge = chat_with_schema({"type": "object", "properties": {"a": {"enum": [f"v-{i}" for i in range(100_000)]}}})
    began = time.perf_counter()
    refused = alice.post("/v1/chat/completions", json={**huge, "model": model})
    refused_s = time.perf_counter() - began
    assert refused.status_code == 400, refused.text
    assert "limit is" in refused.json()["error"]["message"] and refused_s < 1.0, (refused.text, refused_s)

    # 8 large allowed schemas at once from Alice, each client hanging up after ~1 s.
    def abandoned(seed: int) -> None:
        with httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=1.0) as hasty:
            try:
                with hasty.stream("POST", "/v1/chat/completions",
                                  json={**chat_with_schema(large_allowed_schema(seed), stream=True), "model": model}) as r:
                    for _ in r.iter_bytes():
                        pass
            except httpx.TimeoutException:
                pass

    attackers = [threading.Thread(target=abandoned, args=(seed,)) for seed in range(8)]
    for thread in attackers:
        thread.start()
    latencies: dict[str, list[float]] = {call.__name__: [] for call in bob_calls}
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline or any(t.is_alive() for t in attackers):
        for call in bob_calls:
            began = time.perf_counter()
            response = call()
            latencies[call.__name__].append(time.perf_counter() - began)
            assert response.status_code == 200, (call.__name__, response.text)
    for thread in attackers:
        thread.join()
    for name, values in latencies.items():
        p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
        assert p99 < 1.0, f"{name}: p99 {p99:.2f} s over {len(values)} calls while Alice's compiles ran: {values}"

    # Alice's compiles end (started ones finish; queued ones of gone clients never start).
    text = ""
    for _ in range(100):
        text = admin.get("/metrics").text
        if metric(text, "phloem_grammar_compiles_total") + metric(text, "phloem_grammar_compiles_abandoned_total") >= 9:
            break
        time.sleep(0.2)
    assert metric(text, "phloem_grammar_cache_bytes") > 0 and metric(text, "phloem_grammar_cache_entries") >= 1
    assert metric(text, "phloem_grammar_rejections_total") >= 1
    assert metric(text, "phloem_grammar_cache_bytes") <= metric(text, "phloem_grammar_cache_capacity_bytes")
    grown_mb = (server.rss_kib() - start_rss) / 1024
    print(f"refused in {refused_s:.3f} s; Bob's worst: " + ", ".join(
        f"{name} {max(values):.3f} s of {len(values)}" for name, values in latencies.items())
        + f"; RSS {start_rss / 1024:.0f} MB +{grown_mb:.0f} MB; compiles {metric(text, 'phloem_grammar_compiles_total'):.0f}"
        f", abandoned {metric(text, 'phloem_grammar_compiles_abandoned_total'):.0f}"
        f", cache {metric(text, 'phloem_grammar_cache_bytes') / 1e6:.1f} MB")
    assert grown_mb < 300, f"RSS grew {grown_mb:.0f} MB"
    assert responses().status_code == 200
    for client in (alice, bob, admin):
        client.close()
