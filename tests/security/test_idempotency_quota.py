"""Item 4: one key cannot flush another key's saved ``Idempotency-Key`` outcomes.

Alice's append is stored under her ``Idempotency-Key``; Bob then stores many more outcomes than
the per-key quota. Alice's retry must still be replayed (not run a second time: no duplicate
turn), and Bob's own oldest outcomes are the ones dropped.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from live_servers import ServerProcess
import pytest
from tenants import ALICE, BOB, auth, key_args

pytestmark = pytest.mark.slow  # phloem serve processes of its own

QUOTA = 8


def test_a_key_flooding_the_store_evicts_only_its_own_outcomes(tmp_path: Path, model_dir: Path) -> None:
    server = ServerProcess(tmp_path, key_args("--model", str(model_dir), "--idempotency-quota", str(QUOTA))).start()
    try:
        with httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=60) as alice, \
                httpx.Client(base_url=server.base_url, headers=auth(BOB), timeout=60) as bob:
            sid = alice.post("/v1/sessions", json={"text": "ledger"}).json()["id"]
            append = {"input_ids": [5, 6], "generate": {"max_tokens": 2, "ignore_eos": True}}
            retry_key = {"Idempotency-Key": "alice-append-1"}
            first = alice.post(f"/v1/sessions/{sid}/append", json=append, headers=retry_key)
            assert first.status_code == 200
            mine = bob.post("/v1/sessions", json={"text": "noise"}).json()["id"]
            for i in range(5 * QUOTA):
                patched = bob.patch(f"/v1/sessions/{mine}", json={"metadata": {"i": str(i)}},
                                    headers={"Idempotency-Key": f"bob-{i}"})
                assert patched.status_code == 200
            retried = alice.post(f"/v1/sessions/{sid}/append", json=append, headers=retry_key)
            assert retried.status_code == 200 and retried.headers.get("idempotent-replayed") == "true"
            assert retried.json() == first.json()
            assert alice.get(f"/v1/sessions/{sid}").json()["num_turns"] == 2, "the append ran once"
            # Bob's oldest outcome went: the same key runs again (a fresh PATCH, not a replay).
            again = bob.patch(f"/v1/sessions/{mine}", json={"metadata": {"i": "0"}}, headers={"Idempotency-Key": "bob-0"})
            assert again.status_code == 200 and "idempotent-replayed" not in again.headers
            newest = bob.patch(f"/v1/sessions/{mine}", json={"metadata": {"i": str(5 * QUOTA - 1)}},
                               headers={"Idempotency-Key": f"bob-{5 * QUOTA - 1}"})
            assert newest.headers.get("idempotent-replayed") == "true"
    finally:
        server.stop()
