"""Servers for the API tests: a real ``phloem serve`` process, or the app on uvicorn in a thread.

``ServerProcess`` runs ``python3 -m phloem.cli serve`` with any flags on a free loopback
port (its output goes to a log file the tests can read), and can be stopped, killed with SIGKILL
and measured (RSS). ``live_app`` serves ``create_app`` with real uvicorn in a thread of the test
process, so tests get real sockets (client disconnects reach the server) AND the engine client
itself (``LiveApp.stats()``: pages, slots and requests in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
import uvicorn

from phloem.api.server.app import KEEP_ALIVE_S
from phloem.cli.compose import build_app, build_engine, build_sessions
from phloem.cli.config import ServerConfig
from phloem.runtime import EngineClient, EngineStats
from phloem.sessions import SessionManager

__all__ = ["LiveApp", "ServerProcess", "free_port", "live_app"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _release_gpu_memory() -> None:
    """Hand back the GPU memory this test process keeps cached after its earlier tests' engines
    (the caching allocator holds it, and a server child would find the GPU full)."""
    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class ServerProcess:
    """``phloem serve --data-dir DATA_DIR ARGS...`` on a free loopback port (``start``)."""

    data_dir: Path
    args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    log: Path | None = None
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        """Start the process and wait until ``/health`` answers 200."""
        _release_gpu_memory()
        self.log = self.log or self.data_dir / f"server-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        command = [sys.executable, "-m", "phloem.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--data-dir", str(self.data_dir), *self.args]
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n"
                                   f"{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not become healthy:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def rss_kib(self) -> int:
        """Resident memory of the server process, KiB (``/proc``)."""
        assert self.process is not None
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class LiveApp:
    """The app on uvicorn in a thread of this process, with its engine and manager at hand."""

    base_url: str
    engine: EngineClient
    manager: SessionManager
    config: ServerConfig

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http", "ws", 1)

    def stats(self) -> EngineStats:
        """The engine's counters, taken between two steps (from the test's thread)."""
        return asyncio.run(self.engine.stats())

    def wait_idle(self, timeout_s: float = 10.0) -> EngineStats:
        """Wait until no request is in flight in the engine; return its stats then."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.stats()).num_requests:
            assert time.monotonic() < deadline, f"requests still in flight: {stats}"
            time.sleep(0.02)
        return stats


@contextlib.contextmanager
def live_app(model: Path, config: ServerConfig) -> Iterator[LiveApp]:
    """Serve the app on ``127.0.0.1:<free port>`` until the block ends, its engine, sessions and
    app built by ``phloem serve``'s composition root (``cli.compose``) from ``config``.
    ``config.model``, when None, becomes ``model``, so the API names the model it serves."""
    if config.model is None:
        config = dataclasses.replace(config, model=str(model))
    engine = build_engine(config)
    engine.start()
    manager = build_sessions(config, engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        build_app(config, engine, manager), host="127.0.0.1", port=port,
        ws_max_size=config.http.max_body_bytes, lifespan="on", log_level="warning",
        timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, name="live-app", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield LiveApp(f"http://127.0.0.1:{port}", engine, manager, config)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        asyncio.run(engine.shutdown())
