"""Item 5: a Redis that stops answering (``kill -STOP``: the socket stays open, nothing comes back)
holds no turn back.

The server's index goes through the slow proxy of ``redis_support``; holding every chunk 30 s
makes Redis hang for the server (its commands time out after 5 s). While it hangs, appends
commit from the journal: their p99 is within 200 ms of the same appends' p99 on the same server
while Redis answers (a wait on Redis would add its 5 s timeout), and ``/health`` says
``degraded``; once Redis answers again the index is resynced with every turn committed meanwhile.
The bound is relative because a loaded two-core CI machine takes ~0.15 s for such an append with
Redis healthy; on an idle one both sets stay well under 200 ms.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from live_servers import ServerProcess
import pytest
from redis_support import TcpProxy, random_prefix, require_redis
from tenants import ALICE, auth, key_args

from phloem.storage import RedisIndex

pytestmark = pytest.mark.slow  # phloem serve processes of its own


def _wait_for(condition, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_appends_do_not_wait_on_a_hung_redis(tmp_path: Path, model_dir: Path) -> None:
    url, prefix = require_redis(), random_prefix()
    proxy = TcpProxy(url)
    proxy.restore()
    index = RedisIndex(url, prefix=prefix)
    server = ServerProcess(tmp_path, key_args("--model", str(model_dir), "--redis-url", proxy.url),
                           env={"PHLOEM_REDIS_PREFIX": prefix}).start()
    try:
        with httpx.Client(base_url=server.base_url, headers=auth(ALICE), timeout=60) as alice:
            sid = alice.post("/v1/sessions", json={"text": "before the hang"}).json()["id"]
            assert index.get_session(sid) is not None

            def appends(first_id: int) -> list[float]:
                seconds = []
                for i in range(15):
                    start = time.perf_counter()
                    turn = alice.post(f"/v1/sessions/{sid}/append", json={
                        "input_ids": [first_id + i, 6], "generate": {"max_tokens": 1, "ignore_eos": True}})
                    seconds.append(time.perf_counter() - start)
                    assert turn.status_code == 200, turn.text
                return seconds

            healthy = appends(40)
            proxy.delay_s = 30.0  # Redis hangs: every reply is held past the client's timeout
            hung = appends(5)
            # p99 of 15: the slowest.
            assert max(hung) < max(healthy) + 0.2, (
                f"append latencies while Redis hangs: {[round(s, 3) for s in hung]}; "
                f"while it answers: {[round(s, 3) for s in healthy]}")
            _wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=30).json()["status"] == "degraded")
            num_tokens = alice.get(f"/v1/sessions/{sid}").json()["num_tokens"]

            proxy.delay_s = 0.0
            _wait_for(lambda: httpx.get(f"{server.base_url}/health", timeout=30).json()["status"] == "ok")
            record = index.get_session(sid)
            assert record is not None and record.num_tokens == num_tokens, "resynced with every turn"
    finally:
        server.stop()
        proxy.cut()
        index.clear()
        index.close()
