"""The hostile-tenant suite: real ``phloem serve`` processes, real Redis, three API keys.

Every test here plays a tenant (or a web page) attacking another tenant or the server, over
HTTP against a ``python3 -m phloem.cli serve`` process. ``tenants`` is one such server
shared by the tests that need nothing special: keys ``ALICE`` and ``BOB`` (two tenants) and
``ADMIN`` (``tenants.py``), the Redis index (``redis_support.require_redis``; a Redis that does
not answer fails the suite), and one operator-declared shared prefix (``SYSTEM``). Tests that
need other flags start their own server on the suite's model (``model_dir``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_servers import ServerProcess
from redis_support import clear_prefix, random_prefix, require_redis
from tenants import ADMIN, ALICE, BOB, SYSTEM, Tenants, auth, key_args

from phloem.runtime import ensure_default_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model (random weights), built once for the suite."""
    return ensure_default_model(tmp_path_factory.mktemp("security-model"))


@pytest.fixture(scope="session")
def tenants(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Tenants]:
    url, prefix = require_redis(), random_prefix()
    data_dir = tmp_path_factory.mktemp("security-tenants")
    shared = data_dir / "shared.jsonl"
    shared.write_text(json.dumps({"messages": [{"role": "system", "content": SYSTEM}]}) + "\n")
    server = ServerProcess(data_dir, key_args("--model", str(model_dir), "--redis-url", url,
                                              "--shared-prefix-file", str(shared)),
                           env={"PHLOEM_REDIS_PREFIX": prefix}).start()
    clients = [httpx.Client(base_url=server.base_url, headers=auth(k), timeout=60) for k in (ALICE, BOB, ADMIN)]
    try:
        yield Tenants(server, model_dir, *clients)
    finally:
        for client in clients:
            client.close()
        server.stop()
        clear_prefix(url, prefix)
