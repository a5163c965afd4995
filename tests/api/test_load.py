"""Load: 200 concurrent agent sessions against a real ``phloem serve`` (tiny model, loopback,
four API keys), bounded in time. Every request succeeds, every acknowledged turn is committed
exactly (the session's tokens are the inputs and outputs the agent saw), the server's memory
stays bounded, and the latencies are reported (docs/benchmarks.md, "Load, CPU")::

    OMP_NUM_THREADS=1 python3 -m pytest tests/api/test_load.py -q
"""

from __future__ import annotations

import asyncio
import random
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from live_servers import ServerProcess

from phloem.runtime import ensure_default_model

pytestmark = pytest.mark.slow  # phloem serve processes of its own

NUM_AGENTS = 200
NUM_TURNS = 3
KEYS = [f"load-key-{i}-0123456789abcdef" for i in range(4)]
SYSTEM = list(range(10, 58))  # a 48-token system prompt all agents share
APPEND, OUTPUT = 16, 8
WALL_LIMIT_S = 60.0


@dataclass
class Agent:
    index: int
    tokens: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    session: str = ""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("load")
    keys = folder / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    process = ServerProcess(folder, ["--model", str(ensure_default_model(data_dir)),
                                     "--api-keys-file", str(keys)])
    process.start()
    yield process
    process.stop()


async def run_agent(client: httpx.AsyncClient, agent: Agent) -> None:
    rng = random.Random(agent.index)
    first = SYSTEM + [rng.randrange(10, 1000) for _ in range(16)]
    t0 = time.perf_counter()
    created = await client.post("/v1/sessions", json={"input_ids": first})
    agent.latencies.append(time.perf_counter() - t0)
    created.raise_for_status()
    agent.session, agent.tokens = created.json()["id"], first
    for turn in range(1, NUM_TURNS + 1):
        new = [rng.randrange(10, 1000) for _ in range(APPEND)]
        body = {"input_ids": new, "generate": {"max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True}}
        t0 = time.perf_counter()
        response = await client.post(f"/v1/sessions/{agent.session}/append", json=body)
        agent.latencies.append(time.perf_counter() - t0)
        response.raise_for_status()
        result = response.json()
        assert (result["turn"], len(result["output_ids"])) == (turn, OUTPUT), result
        agent.tokens += new + result["output_ids"]
        assert result["num_tokens"] == len(agent.tokens)


async def run_all(server: ServerProcess) -> tuple[list[Agent], float]:
    agents = [Agent(i) for i in range(NUM_AGENTS)]
    clients = [httpx.AsyncClient(base_url=server.base_url, timeout=WALL_LIMIT_S,
                                 headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=NUM_AGENTS))
               for key in KEYS]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(run_agent(clients[a.index % len(clients)], a) for a in agents))
        wall = time.perf_counter() - t0
        # Every acknowledged turn is in the session, token for token.
        for agent in agents:
            client = clients[agent.index % len(clients)]
            turns = (await client.get(f"/v1/sessions/{agent.session}/turns",
                                      params={"include_tokens": True})).json()["turns"]
            assert len(turns) == NUM_TURNS + 1
            assert [t for turn in turns for t in turn["token_ids"]] == agent.tokens
    finally:
        for client in clients:
            await client.aclose()
    return agents, wall


async def delete_all(server: ServerProcess, agents: list[Agent]) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        for agent in agents:
            key = KEYS[agent.index % len(KEYS)]
            response = await client.delete(f"/v1/sessions/{agent.session}",
                                           headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 204


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def test_200_concurrent_agents(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    # Warm up (first requests build caches and import lazily), then measure from there.
    asyncio.run(delete_all(server, asyncio.run(run_all_small(server))))
    rss_before = server.rss_kib()
    agents, wall = asyncio.run(run_all(server))
    rss_loaded = server.rss_kib()
    asyncio.run(delete_all(server, agents))
    rss_after = server.rss_kib()

    assert wall <= WALL_LIMIT_S
    appends = [t for a in agents for t in a.latencies[1:]]
    creates = [a.latencies[0] for a in agents]
    num_requests = len(appends) + len(creates)
    report = (f"load: {NUM_AGENTS} agents x {NUM_TURNS} turns ({num_requests} requests, "
              f"{len(appends) * OUTPUT} generated tokens) in {wall:.1f} s = "
              f"{num_requests / wall:.0f} req/s; append latency p50 {percentile(appends, 50) * 1e3:.0f} ms, "
              f"p99 {percentile(appends, 99) * 1e3:.0f} ms, max {max(appends) * 1e3:.0f} ms; "
              f"create p50 {percentile(creates, 50) * 1e3:.0f} ms, p99 {percentile(creates, 99) * 1e3:.0f} ms; "
              f"server RSS {rss_before / 1024:.0f} MiB before, {rss_loaded / 1024:.0f} MiB loaded, "
              f"{rss_after / 1024:.0f} MiB after deleting")
    with capsys.disabled():
        print(f"\n{report}")
    # Bounded: 200 sessions of ~100 tokens are small; the pools were allocated at start.
    assert rss_loaded - rss_before < 256 * 1024, report
    assert rss_after - rss_before < 256 * 1024, report


async def run_all_small(server: ServerProcess) -> list[Agent]:
    agents = [Agent(NUM_AGENTS + i) for i in range(8)]
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
        for agent in agents:
            client.headers["Authorization"] = f"Bearer {KEYS[agent.index % len(KEYS)]}"
            await run_agent(client, agent)
    return agents


def test_an_idle_keep_alive_connection_outlives_the_clients_expiry(server: ServerProcess) -> None:
    """The cause of lost requests under load: the server closed idle keep-alive connections after
    5 s, exactly when httpx's pool (``keepalive_expiry``, 5 s) still reuses them, so a request
    sent as the server closed was reset (``httpx.ReadError``). Idle past the client's expiry,
    the connection must still carry a request."""
    host, port = server.base_url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for _ in range(2):
            conn.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                assert chunk, "the server closed the idle keep-alive connection"
                head += chunk
            assert head.startswith(b"HTTP/1.1 200"), head[:100]
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            body = head.partition(b"\r\n\r\n")[2]
            while len(body) < length:
                body += conn.recv(65536)
            time.sleep(httpx.Limits().keepalive_expiry + 1.0)
