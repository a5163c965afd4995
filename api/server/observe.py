"""Every HTTP request and WebSocket, observed once: its request id, one log line, its metrics.

``RequestObserver`` wraps the whole Litestar ASGI handler (outside routing and the exception
handlers), so it sees every answer — 404s of unknown routes, 401s of the auth middleware, 413s
— and its context holds the request id while the request is served:

- ``X-Request-Id``: a client's id is echoed when it is 1-128 characters of
  ``[A-Za-z0-9._:-]``; otherwise (absent, too long, other characters) a fresh ``req_`` + 32 hex
  digits is used instead (never an error: a tracing header must not fail a request). The id is
  sent back on every response (and on the WebSocket handshake), is in every log line of the
  request (``runtime.logs.bind_request_id``; the generation a request starts keeps it), and in
  problem+json error bodies (``request_id``).
- one ``http.request`` log line when the response's last byte is sent (a stream's when it
  ends; a WebSocket's when it closes): method, path, route, status, duration_ms, owner (the
  authenticated key's owner id, when a key was checked) and client address. ``/health`` and
  ``/metrics`` are logged at DEBUG (probes would flood the log), 5xx at WARNING.
- ``ApiMetrics.observe_request``: the count and duration by method, route template and status.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterable

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from phloem.api.server.auth import Principal
from phloem.api.server.metrics import ApiMetrics
from phloem.runtime.logs import bind_request_id, log_event

__all__ = ["REQUEST_ID_HEADER", "RequestObserver", "request_id_of"]

logger = logging.getLogger("phloem.api.access")

REQUEST_ID_HEADER = "X-Request-Id"
_HEADER_KEY = REQUEST_ID_HEADER.lower().encode()
_VALID_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_QUIET_PATHS = ("/health", "/metrics")
_MAX_LOGGED_PATH = 256


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request id for a request with these raw headers: the client's valid
    ``X-Request-Id``, else a fresh one."""
    sent = next((v for k, v in headers if k == _HEADER_KEY), None)
    if sent is not None and _VALID_ID.fullmatch(sent):
        return sent.decode("ascii")
    return f"req_{uuid.uuid4().hex}"


class RequestObserver:
    """ASGI middleware around the app (see the module docstring).

    Args:
        app: The wrapped ASGI app (Litestar's handler).
        metrics: Receives each request's method, route, status and duration.
    """

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self._app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        header = (_HEADER_KEY, request_id.encode())
        path, start = scope["path"], time.perf_counter()
        status: list[int] = []

        async def observed_send(message: Message) -> None:
            kind = message["type"]
            if kind in ("http.response.start", "websocket.accept"):
                message["headers"] = [*(message.get("headers") or ()), header]  # type: ignore[typeddict-unknown-key]
                status.append(message.get("status", 101))
            elif kind == "websocket.close" and not status:
                # Closed before the handshake was accepted: refused (403 in uvicorn's terms).
                status.append(403)
            await send(message)

        with bind_request_id(request_id):
            try:
                await self._app(scope, receive, observed_send)
            finally:
                self._record(scope, path, status[0] if status else 500, time.perf_counter() - start)

    def _record(self, scope: Scope, path: str, status: int, seconds: float) -> None:
        method = scope.get("method", "WS") if scope["type"] == "http" else "WS"
        route = scope.get("path_template") or "unmatched"
        self._metrics.observe_request(method, route, status, seconds)
        principal = scope.get("auth")
        client = scope.get("client")
        level = (logging.WARNING if status >= 500 else
                 logging.DEBUG if path in _QUIET_PATHS else logging.INFO)
        log_event(logger, "http.request", level, method=method, path=path[:_MAX_LOGGED_PATH],
                  route=route, status=status, duration_ms=round(1000 * seconds, 2),
                  owner=principal.owner if isinstance(principal, Principal) else None,
                  client=f"{client[0]}:{client[1]}" if client else None)
