"""Redis for the tests: the server CI guarantees, a unique key prefix per test, and a TCP proxy
that can be cut and restored to make Redis "unreachable" without touching the shared server.

``PHLOEM_TEST_REDIS_URL`` names the server (default ``redis://127.0.0.1:6379/0``); set to ''
to opt out, and only then do Redis cases skip. Otherwise a Redis that does not answer FAILS the
test (``require_redis``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from phloem.storage import RedisIndex

__all__ = ["TcpProxy", "clear_prefix", "random_prefix", "redis_test_url", "require_redis"]

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_test_url() -> str:
    """The test server's URL; '' when Redis tests are disabled."""
    return os.environ.get("PHLOEM_TEST_REDIS_URL", DEFAULT_REDIS_URL)


def random_prefix() -> str:
    return f"phloem-test:{secrets.token_hex(8)}:"


def require_redis() -> str:
    """The URL of a Redis that answers; skip only when opted out, else fail."""
    url = redis_test_url()
    if not url:
        pytest.skip("PHLOEM_TEST_REDIS_URL is empty: Redis index tests disabled")
    probe = RedisIndex(url, prefix=random_prefix())
    healthy = probe.health()
    probe.close()
    if not healthy:
        pytest.fail(f"no Redis server answers at {url} (set PHLOEM_TEST_REDIS_URL='' to opt out)")
    return url


def clear_prefix(url: str, prefix: str) -> None:
    """Delete every key under ``prefix`` (and nothing else)."""
    index = RedisIndex(url, prefix=prefix)
    index.clear()
    index.close()


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to the Redis of ``target_url``; ``cut`` drops the listener
    and every connection (clients see refused/reset connections), ``restore`` listens again on
    the same port. ``delay_s`` (settable any time) holds each forwarded chunk that long, to make
    the index slow rather than gone."""

    def __init__(self, target_url: str) -> None:
        parts = urlsplit(target_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self._path = parts.path
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.delay_s = 0.0
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}{self._path}"

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        for sock in [*conns, *([listener] if listener else [])]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
