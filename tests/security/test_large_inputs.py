"""Item 2: one key's huge input never stalls the server for the others.

While Alice sends multi-megabyte bodies (a 7 MB ``text`` append, 7 MB of chat messages, a 7 MB
completion prompt), ``/health`` and Bob's token stream must keep answering within 250 ms, and
each body is refused with ``context_length_exceeded`` without being tokenized (its length alone
cannot fit the context window). Two million ``input_ids`` are refused from their count.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tenants import BOB, Tenants, auth

pytestmark = pytest.mark.slow  # the suite's phloem serve process (`tenants`)

LIMIT_S = 0.25
SEVEN_MB = 7 * 1024 * 1024


class _Watch:
    """Polls ``/health`` and reads Bob's SSE stream on threads, recording the worst waits."""

    def __init__(self, base_url: str, bob_session: str) -> None:
        self.base_url, self.session = base_url, bob_session
        self.health_s: list[float] = []
        self.gaps_s: list[float] = []
        self.done = threading.Event()
        self.stream_started = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._poll, self._stream)]

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while not self.done.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                self.health_s.append(time.perf_counter() - start)
                time.sleep(0.02)

    def _stream(self) -> None:
        body = {"input_ids": [5, 6, 7], "stream": True,
                "generate": {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}}
        with httpx.Client(base_url=self.base_url, headers=auth(BOB), timeout=60) as client, \
                client.stream("POST", f"/v1/sessions/{self.session}/append", json=body) as response:
            last = None
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    self.gaps_s.append(now - last)
                last = now
                self.stream_started.set()
                if self.done.is_set():
                    break

    def __enter__(self) -> _Watch:
        for thread in self.threads:
            thread.start()
        assert self.stream_started.wait(60), "Bob's stream did not start"
        time.sleep(0.3)
        self.health_s.clear()
        self.gaps_s.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self.done.set()
        for thread in self.threads:
            thread.join(60)


def _refused_fast(send: Callable[[], httpx.Response]) -> float:
    start = time.perf_counter()
    response = send()
    seconds = time.perf_counter() - start
    assert response.status_code == 400, response.text[:300]
    body: dict[str, Any] = response.json()
    code = body.get("code") or body["error"]["code"]
    assert code == "context_length_exceeded", body
    return seconds


def test_huge_bodies_do_not_stall_health_or_another_keys_stream(tenants: Tenants) -> None:
    alice, bob = tenants.alice, tenants.bob
    model = alice.get("/v1/models").json()["data"][0]["id"]
    mine = alice.post("/v1/sessions", json={"text": "hello"}).json()["id"]
    theirs = bob.post("/v1/sessions", json={"text": "a long story"}).json()["id"]
    text = ("All work and no play makes Jack a dull boy. " * (SEVEN_MB // 44 + 1))[:SEVEN_MB]
    sends = [
        lambda: alice.post(f"/v1/sessions/{mine}/append", json={"text": text}),
        lambda: alice.post(f"/v1/sessions/{mine}/append",
                           json={"messages": [{"role": "tool", "content": text}]}),
        lambda: alice.post("/v1/completions", json={"model": model, "prompt": text}),
    ]
    with _Watch(tenants.server.base_url, theirs) as watch:
        took = [_refused_fast(send) for send in sends]
    assert watch.health_s and watch.gaps_s
    assert max(watch.health_s) < LIMIT_S, f"/health took up to {max(watch.health_s):.3f} s"
    assert max(watch.gaps_s) < LIMIT_S, f"Bob's stream stopped for up to {max(watch.gaps_s):.3f} s"
    assert max(took) < 5.0, took
    # Nothing of the refused input was committed.
    assert alice.get(f"/v1/sessions/{mine}").json()["num_turns"] == 1


def test_two_million_input_ids_are_refused_from_their_count(tenants: Tenants) -> None:
    mine = tenants.alice.post("/v1/sessions", json={"text": "hello"}).json()["id"]
    ids = json.dumps({"input_ids": [17] * 2_000_000}).encode()
    seconds = _refused_fast(lambda: tenants.alice.post(f"/v1/sessions/{mine}/append", content=ids,
                                                       headers={"Content-Type": "application/json"}))
    assert seconds < 5.0
