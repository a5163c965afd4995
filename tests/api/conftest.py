"""Fixtures for the server tests.

``server``: a REAL ``phloem serve`` process (``python3 -m phloem.cli serve``) on a free
loopback port, serving its default model (the trained built-in one, ``DEFAULT_MODEL_NAME``)
from a temporary data dir; it is started once for the test session and terminated at the end.

``app_client``: the same app and model in process (``create_app`` + Litestar's ``TestClient``)
over its own engine, with an admission limit of one generation (to reach 503), for tests that
need ``websocket_connect`` in process or a config the CLI does not expose.

``random_server``: the same as ``server`` with the random-weight model (``--model``), started
only for the tests that ask for it. ``data_dir`` holds that model (``ensure_default_model``),
built once, for every test that serves it explicitly: they address it as ``RANDOM_MODEL_NAME``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from phloem.api import Client
from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.runtime import EngineClient, ensure_default_model
from phloem.runtime.builtin_model import trained_model_path
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint


@dataclass(frozen=True)
class Server:
    base_url: str
    data_dir: Path
    log: Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("phloem-server")
    ensure_default_model(folder)  # the random model, built once here for the tests that serve it
    return folder


def _serve(data_dir: Path, log: Path, args: list[str]) -> Iterator[Server]:
    port = _free_port()
    # One intra-op thread: the tiny model gains nothing from more on the 2-core CI machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "phloem.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--data-dir", str(data_dir), *args]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not become healthy:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield Server(base_url, data_dir, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def server(data_dir: Path) -> Iterator[Server]:
    yield from _serve(data_dir, data_dir / "server.log", [])


@pytest.fixture(scope="session")
def random_server(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``phloem serve --model`` the random-weight model (``RANDOM_MODEL_NAME``), for the tests
    that need spread-out next-token probabilities (samples that differ); its own data dir."""
    folder = tmp_path_factory.mktemp("phloem-random-server")
    yield from _serve(folder, folder / "server.log", ["--model", str(ensure_default_model(data_dir))])


@pytest.fixture(scope="session")
def speculative_server(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``phloem serve --speculative mtp:3`` on the trained built-in model (its own data dir),
    started only for the tests that ask for it."""
    folder = tmp_path_factory.mktemp("phloem-speculative-server")
    yield from _serve(folder, folder / "server.log", ["--speculative", "mtp:3"])


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.base_url, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def app_client(tmp_path_factory: pytest.TempPathFactory,
               data_dir: Path) -> Iterator[TestClient]:  # type: ignore[type-arg]
    folder = tmp_path_factory.mktemp("phloem-inprocess")
    model = trained_model_path()  # the server's model; sessions live in `folder`
    engine = EngineClient.from_pretrained(model)
    engine.start()
    sessions = SessionConfig(data_dir=folder, max_num_generations=1, retry_after_s=2.0)
    manager = SessionManager(engine, Tokenizer.from_pretrained(model), sessions,
                             model_fingerprint=model_fingerprint(model))
    app = create_app(HttpConfig(max_body_bytes=1 << 20), engine, manager, model=str(model))
    try:
        with TestClient(app, base_url="http://127.0.0.1", timeout=60) as test_client:
            yield test_client
    finally:
        asyncio.run(engine.shutdown())
