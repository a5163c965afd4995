"""Browser attacks on the server: DNS rebinding and cross-site requests (docs/api.md, "Security
model").

``RequestGuard`` runs before authentication on every HTTP request and WebSocket handshake:

- **Host and Origin.** A page on ``attacker.example`` whose name resolves to 127.0.0.1 (DNS
  rebinding) reaches a loopback server with ``Host: attacker.example``; any page can send a
  request (or open a WebSocket, which no CORS check covers) from its own ``Origin``. So when the
  check is on, a request whose ``Host`` is not an accepted name, or that carries an ``Origin``
  whose host is not one, is refused (400 ``invalid_request``; a WebSocket handshake is refused
  with 403 before it is accepted). Accepted: the loopback names (``localhost``, 127.0.0.0/8,
  ``::1``) with any port, and ``HttpConfig.allowed_hosts``. The check is on without API keys
  (where the key is the only other barrier, and there is none), and with keys when
  ``allowed_hosts`` names any host. A request without ``Host`` (HTTP/1.0) or ``Origin`` (not a
  browser) passes.
- **JSON bodies.** A browser sends ``text/plain``, form and multipart bodies cross-site without
  asking (a "simple" request); JSON needs a CORS preflight that this server never grants. So a
  ``POST``, ``PUT`` or ``PATCH`` under ``/v1/`` with a body must say ``Content-Type:
  application/json`` (or ``application/<x>+json``), else 415 ``unsupported_media_type``. A
  request without a body needs no type (``/offload``, ``/prefetch``); routes that need a body
  answer 400 when it is empty.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send, WebSocketCloseEvent

from phloem.api.schemas import ErrorCode
from phloem.api.server.errors import ApiError

__all__ = ["RequestGuard", "host_name"]

_BODY_METHODS = ("POST", "PUT", "PATCH")
_HEADERS = (b"host", b"origin", b"content-type", b"content-length", b"transfer-encoding")


def host_name(value: str) -> str:
    """The host of a ``Host`` header value (``name``, ``name:port``, ``[v6]:port``), lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    return name if sep and port.isdigit() and ":" not in name else value


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class RequestGuard(ASGIMiddleware):
    """Refuses foreign ``Host`` / ``Origin`` names and non-JSON bodies (module docstring).

    Args:
        check_hosts: Whether the ``Host`` / ``Origin`` check is on.
        allowed_hosts: Names accepted besides the loopback ones.
    """

    scopes = (ScopeType.HTTP, ScopeType.WEBSOCKET)

    def __init__(self, check_hosts: bool, allowed_hosts: Iterable[str]) -> None:
        self._check_hosts = check_hosts
        self._allowed = frozenset(host_name(h) for h in allowed_hosts)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers: dict[str, list[str]] = {}
        for key, value in scope["headers"]:
            if key in _HEADERS:
                headers.setdefault(key.decode(), []).append(value.decode("latin-1"))
        problem = self._host_problem(headers) if self._check_hosts else None
        if problem is not None and scope["type"] == ScopeType.WEBSOCKET:
            close: WebSocketCloseEvent = {"type": "websocket.close", "code": 1008, "reason": problem[:120]}
            await send(close)  # before accept: the server answers the handshake with 403
            return
        if problem is not None:
            raise ApiError(ErrorCode.INVALID_REQUEST, problem)
        if scope["type"] == ScopeType.HTTP and scope["method"] in _BODY_METHODS and scope["path"].startswith("/v1/"):
            _check_json(headers)
        await next_app(scope, receive, send)

    def _host_problem(self, headers: dict[str, list[str]]) -> str | None:
        for host in headers.get("host", ()):
            if not self._accepts(host_name(host)):
                return (f"Host: {host[:80]!r} is not a name this server answers to (loopback names, "
                        "and --allowed-host); a request for another name is refused (DNS rebinding)")
        for origin in headers.get("origin", ()):
            if not self._accepts((urlsplit(origin).hostname or "").lower()):
                return (f"Origin: {origin[:80]!r} is not a site this server answers to (loopback "
                        "names, and --allowed-host); cross-site browser requests are refused")
        return None

    def _accepts(self, name: str) -> bool:
        return bool(name) and (_is_loopback(name) or name in self._allowed)


def _check_json(headers: dict[str, list[str]]) -> None:
    kind = next(iter(headers.get("content-type", ())), None)
    length = next(iter(headers.get("content-length", ())), "0").strip()
    has_body = length not in ("", "0") or "transfer-encoding" in headers
    if kind is None and not has_body:
        return
    media = (kind or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise ApiError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                   f"Content-Type: expected application/json, got {(kind or 'none')[:80]!r}")
