"""Item 1: the prefix cache is partitioned by API key; only the operator's shared prefix is shared.

Bob probes Alice's conversation (her exact tokens plus a few of his own) on every route that
reports ``cached_tokens``: he must see 0 cached tokens and no speed-up, while Alice's own next
turn still hits her whole conversation, and both hit the shared system prompt. ``/metrics``
(every key's counters) is for admin keys only.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import httpx
import pytest
from tenants import SYSTEM, Tenants
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow  # the suite's phloem serve process (`tenants`)

GREEDY = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1800) for _ in range(n)]


def _session_tokens(client: httpx.Client, session_id: str) -> list[int]:
    turns = client.get(f"/v1/sessions/{session_id}/turns", params={"include_tokens": True}).json()["turns"]
    return [t for turn in turns for t in turn["token_ids"]]


def _completion(client: httpx.Client, prompt: list[int], model: str) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": model, "prompt": prompt, **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_another_key_cannot_hit_a_conversation_and_the_owner_still_does(tenants: Tenants) -> None:
    alice, bob = tenants.alice, tenants.bob
    model = alice.get("/v1/models").json()["data"][0]["id"]
    secret = "The vault code is 4 7 1. Remember it."
    created = alice.post("/v1/sessions", json={"messages": [{"role": "user", "content": secret}]}).json()
    sid = created["id"]
    first = alice.post(f"/v1/sessions/{sid}/append", json={"generate": {"max_tokens": 4, "ignore_eos": True}}).json()
    conversation = _session_tokens(alice, sid)
    assert first["num_tokens"] == len(conversation)

    # Bob sends Alice's exact tokens plus his own, as text-completion token ids: nothing cached.
    probe = _completion(bob, conversation + [42, 43], model)
    assert _cached(probe) == 0 and probe["usage"]["prompt_tokens"] == len(conversation) + 2
    # The same with her text, as chat messages and as a session of his own.
    chat = bob.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": secret}], **GREEDY}).json()
    assert _cached(chat) == 0
    bob_session = bob.post("/v1/sessions", json={"input_ids": conversation + [7]}).json()["id"]
    bob_turn = bob.post(f"/v1/sessions/{bob_session}/append", json={"generate": GREEDY}).json()
    # Only Bob's own: his chat request above shared its first page with his completion probe and
    # published a branch-point checkpoint there, in his namespace (issue 48); nothing of Alice's.
    assert bob_turn["usage"]["cached_tokens"] == 16 < len(conversation)

    # Alice's next turn still hits her whole conversation, as with a single tenant.
    again = alice.post(f"/v1/sessions/{sid}/append", json={"input_ids": [5, 6], "generate": GREEDY}).json()
    assert again["usage"]["cached_tokens"] == len(conversation)
    mine = _completion(alice, conversation + [42, 43], model)
    assert _cached(mine) == len(conversation)


def test_the_shared_prefix_is_hit_by_every_key(tenants: Tenants) -> None:
    hf = AutoTokenizer.from_pretrained(str(tenants.model_dir))
    system = {"role": "system", "content": SYSTEM}
    num_shared = len(hf.encode(hf.apply_chat_template([system], tokenize=False), add_special_tokens=False))
    model = tenants.alice.get("/v1/models").json()["data"][0]["id"]
    for client, question in ((tenants.alice, "Where is my parcel 8812?"), (tenants.bob, "Cancel order 5531.")):
        body = client.post("/v1/chat/completions", json={
            "model": model, "messages": [system, {"role": "user", "content": question}], **GREEDY}).json()
        assert _cached(body) == num_shared, body["usage"]
    # Alice's question below the shared prompt stays hers: Bob asking it hits the shared part only.
    same = tenants.bob.post("/v1/chat/completions", json={
        "model": model, "messages": [system, {"role": "user", "content": "Where is my parcel 8812?"}],
        **GREEDY}).json()
    assert _cached(same) == num_shared


def test_a_probe_of_another_keys_prompt_is_not_faster(tenants: Tenants) -> None:
    """Timing: Bob's probe of Alice's prompt costs what a fresh prompt costs; Alice's own repeat
    (a real hit, the positive control) is several times faster."""
    alice, bob = tenants.alice, tenants.bob
    model = alice.get("/v1/models").json()["data"][0]["id"]
    rng = random.Random(29)

    def timed(client: httpx.Client, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        body = _completion(client, prompt, model)
        return time.perf_counter() - start, _cached(body)

    probe_s, fresh_s, hit_s = [], [], []
    for _ in range(4):
        secret = _ids(rng, 1500)
        _completion(alice, secret, model)  # Alice's prompt is cached (in her namespace)
        seconds, cached = timed(bob, secret + [11])
        assert cached == 0
        probe_s.append(seconds)
        seconds, cached = timed(bob, _ids(rng, 1500) + [11])
        assert cached == 0
        fresh_s.append(seconds)
        seconds, cached = timed(alice, secret + [11])
        assert cached >= 1500 - 16
        hit_s.append(seconds)
    probe, fresh, hit = (statistics.median(s) for s in (probe_s, fresh_s, hit_s))
    assert hit < 0.5 * fresh, f"the control: a real hit ({hit:.3f} s) is faster than a miss ({fresh:.3f} s)"
    assert probe > 0.7 * fresh, f"Bob's probe took {probe:.3f} s, a fresh prompt {fresh:.3f} s"


def test_metrics_are_for_admin_keys_only(tenants: Tenants) -> None:
    assert httpx.get(f"{tenants.server.base_url}/metrics", timeout=30).status_code == 401
    refused = tenants.bob.get("/metrics")
    assert refused.status_code == 403 and refused.json()["code"] == "forbidden"
    scraped = tenants.admin.get("/metrics")
    assert scraped.status_code == 200 and "phloem_cached_tokens_total" in scraped.text
