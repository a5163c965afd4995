"""``kill -9`` of a real server in the middle of generations, then a restart on the same data
directory: no acknowledged turn is lost (every turn a client got a 200 for is there, token for
token), a turn that was generating when the process died is simply absent, the sessions still
belong to their keys, and they accept appends again. Only the public API is used."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from live_servers import ServerProcess

from phloem.runtime import ensure_default_model

pytestmark = pytest.mark.slow  # phloem serve processes of its own

KEY, OTHER = "faults-key-0123456789abcdef", "faults-other-key-0123456789"
NUM_WORKERS = 6
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@dataclass
class Worker:
    session: str
    acked: list[dict[str, object]] = field(default_factory=list)  # {"turn", "input", "output"}
    error: BaseException | None = None


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[tuple[Path, list[str]]]:
    folder = tmp_path_factory.mktemp("faults")
    keys = folder / "keys"
    keys.write_text(f"{KEY}\n{OTHER}\n")
    yield folder, ["--model", str(ensure_default_model(data_dir)), "--api-keys-file", str(keys)]


def client(server: ServerProcess, key: str = KEY) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, timeout=30, headers={"Authorization": f"Bearer {key}"})


def append_until_killed(server: ServerProcess, worker: Worker, stop: threading.Event) -> None:
    with client(server) as http:
        turn = 0
        while not stop.is_set():
            new = [10 + (turn * 7 + i) % 500 for i in range(12)]
            try:
                response = http.post(f"/v1/sessions/{worker.session}/append",
                                     json={"input_ids": new, "generate": GREEDY})
            except httpx.TransportError:
                return  # the server died mid-request: this turn was never acknowledged
            if response.status_code != 200:
                worker.error = AssertionError(response.text)
                return
            result = response.json()
            worker.acked.append({"turn": result["turn"], "input": new, "output": result["output_ids"]})
            turn += 1


def test_kill_9_mid_generation_loses_no_acknowledged_turn(folder: tuple[Path, list[str]]) -> None:
    data_dir, args = folder
    first = ServerProcess(data_dir, args).start()
    try:
        with client(first) as http:
            workers = [Worker(http.post("/v1/sessions", json={"text": f"agent {i}"}).json()["id"])
                       for i in range(NUM_WORKERS)]
            long_session = http.post("/v1/sessions", json={"text": "long"}).json()["id"]
        stop = threading.Event()
        threads = [threading.Thread(target=append_until_killed, args=(first, w, stop)) for w in workers]
        for thread in threads:
            thread.start()
        with client(first) as http, http.stream(
                "POST", f"/v1/sessions/{long_session}/append",
                json={"text": " on and on", "generate": {**GREEDY, "max_tokens": 4000}, "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            deadline = time.monotonic() + 20
            while min(len(w.acked) for w in workers) < 3:
                assert time.monotonic() < deadline and all(t.is_alive() for t in threads)
                time.sleep(0.02)
            first.kill()  # SIGKILL while the long generation and the workers' appends run
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        first.stop()
    assert not [w.error for w in workers if w.error], "every append before the kill succeeded"

    second = ServerProcess(data_dir, args, log=first.log).start()
    try:
        with client(second) as http, client(second, OTHER) as other:
            for worker in workers:
                response = http.get(f"/v1/sessions/{worker.session}/turns", params={"include_tokens": True})
                assert response.status_code == 200, response.text
                turns = response.json()["turns"]
                for acked in worker.acked:
                    turn = turns[int(acked["turn"])]  # type: ignore[call-overload]
                    assert turn["token_ids"][-len(acked["output"]):] == acked["output"]  # type: ignore[arg-type]
                    assert turn["token_ids"][:len(acked["input"])] == acked["input"]  # type: ignore[arg-type]
                # At most the one turn whose answer the kill swallowed was committed on top.
                assert len(worker.acked) + 1 <= len(turns) <= len(worker.acked) + 2
                expect(other.get(f"/v1/sessions/{worker.session}"), 404)
            long_turns = http.get(f"/v1/sessions/{long_session}/turns").json()["turns"]
            assert len(long_turns) == 1, "the generation in flight at the kill was not committed"
            # The sessions work again (their state is recomputed from the committed tokens).
            for worker in [*workers[:2]]:
                again = http.post(f"/v1/sessions/{worker.session}/append",
                                  json={"input_ids": [11, 12], "generate": GREEDY})
                assert again.status_code == 200, again.text
            listed = {s["id"] for s in http.get("/v1/sessions", params={"limit": 100}).json()["sessions"]}
            assert {w.session for w in workers} | {long_session} <= listed
    finally:
        second.stop()


def expect(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
