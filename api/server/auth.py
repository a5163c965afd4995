"""API keys (docs/api.md, "Auth"): who sent a request, checked once per request or handshake.

``AuthMiddleware`` runs before every route under ``/v1/`` and ``/metrics`` (``/health`` and the
OpenAPI schema are public). It reads ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``,
Anthropic's header, from clients that send no ``Authorization``) and stores the caller's
``Principal`` in the ASGI scope (``scope["auth"]``), where ``principal_of`` finds it. A missing
or unknown key is refused before the route runs: an HTTP request gets a 401 ``unauthorized``
(through the app's exception handler, so OpenAI paths get OpenAI's envelope); a WebSocket is
accepted, sent one ``error`` event and closed with 4401, as docs/api.md says for fatal socket
errors. A request with two ``Authorization`` headers is refused (400): which one a proxy or the
server would honour is ambiguous; so is one with both ``Authorization`` and ``x-api-key``.

Decision: a session's owner is ``key_`` + the first 32 hex digits of the HMAC-SHA256 of the key
under the server's secret (``storage.server_secret``, kept in the data directory), never the key:
owners are persisted (journal, index) and must not disclose the secret, and a copy of the data
directory's records alone (without the secret) does not let anyone test key guesses offline.
Owners derived by the former unkeyed rule (``legacy_owner_id``) are renamed once at start
(``KeyRing.renames``). The lookup is a dict keyed by the key's SHA-256 digest, so a wrong key's
timing tells nothing about the right one's characters. Without configured keys every request is
the one ``ANONYMOUS`` principal (an admin: listing all sessions then lists its own).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import (
    ASGIApp, Receive, Scope, Send, WebSocketAcceptEvent, WebSocketCloseEvent, WebSocketSendEvent,
)

from phloem.api.schemas import ERROR_STATUS, ErrorCode, ErrorEvent
from phloem.api.server.errors import ApiError
from phloem.api.server.config import ApiKey

__all__ = ["ANONYMOUS", "AuthMiddleware", "KeyRing", "Principal", "legacy_owner_id", "owner_id",
           "principal_of"]

_PROTECTED_PREFIXES = ("/v1/", "/metrics")


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of a request.

    Args:
        owner: The owner id its sessions are stored under (never the key itself).
        admin: It may list every owner's sessions.
    """

    owner: str
    admin: bool = False


ANONYMOUS = Principal("anonymous", admin=True)
"""The caller of every request on a server without API keys."""


def owner_id(secret: str, server_secret: bytes) -> str:
    """The owner id of an API key: ``key_`` + 32 hex digits of its HMAC-SHA256 under the
    server's secret."""
    return "key_" + hmac.new(server_secret, secret.encode(), hashlib.sha256).hexdigest()[:32]


def legacy_owner_id(secret: str) -> str:
    """The owner id an API key had before owners were keyed: 32 hex digits of its SHA-256."""
    return "key_" + hashlib.sha256(secret.encode()).hexdigest()[:32]


class KeyRing:
    """The accepted keys, by the SHA-256 of each.

    Args:
        keys: The server's API keys; empty disables authentication.
        server_secret: The key of the owner-id HMAC (``storage.server_secret``).
    """

    def __init__(self, keys: Sequence[ApiKey], server_secret: bytes) -> None:
        self._by_digest = {hashlib.sha256(k.secret.encode()).digest(): Principal(owner_id(k.secret, server_secret),
                                                                                 k.admin)
                           for k in keys}
        self._renames = {legacy_owner_id(k.secret): owner_id(k.secret, server_secret) for k in keys}

    @property
    def enabled(self) -> bool:
        """Requests must carry a key."""
        return bool(self._by_digest)

    @property
    def num_admin(self) -> int:
        return sum(p.admin for p in self._by_digest.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    def renames(self) -> Mapping[str, str]:
        """Each key's former (unkeyed) owner id -> its owner id: sessions stored under the
        former are moved to the latter at start."""
        return dict(self._renames)

    def owners(self) -> Iterable[str]:
        """Every owner a session can belong to: each key's, and the anonymous one (sessions
        created before keys were configured)."""
        return sorted({ANONYMOUS.owner, *(p.owner for p in self._by_digest.values())})

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an ``Authorization`` header value, or None if it names no key.

        Args:
            authorization: The header's value (``Bearer <key>``), if any.

        Returns:
            ``ANONYMOUS`` when keys are disabled; else the key's principal, or None.
        """
        if not self._by_digest:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self._by_digest.get(hashlib.sha256(token.strip().encode()).digest())


def principal_of(connection: Any) -> Principal:
    """The principal ``AuthMiddleware`` stored for this request or socket.

    Args:
        connection: A Litestar ``Request`` or ``WebSocket``.

    Returns:
        Its principal (``ANONYMOUS`` on a route the middleware does not guard).
    """
    principal = connection.scope.get("auth")
    return principal if isinstance(principal, Principal) else ANONYMOUS


class AuthMiddleware(ASGIMiddleware):
    """Authenticates every HTTP request and WebSocket handshake under ``/v1/``.

    Args:
        keys: The accepted keys.
    """

    scopes = (ScopeType.HTTP, ScopeType.WEBSOCKET)

    def __init__(self, keys: KeyRing) -> None:
        self._keys = keys

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if not scope["path"].startswith(_PROTECTED_PREFIXES):
            await next_app(scope, receive, send)
            return
        headers = [v for k, v in scope["headers"] if k == b"authorization"]
        api_keys = [b"Bearer " + v for k, v in scope["headers"] if k == b"x-api-key"]
        if len(headers) + len(api_keys) > 1:
            detail = (f"Authorization: expected one header, got {len(headers)}" if len(headers) > 1
                      else "expected one API key header: send `Authorization` or `x-api-key`, not both")
            if scope["type"] == ScopeType.WEBSOCKET:
                await _refuse_socket(receive, send, detail)
                return
            raise ApiError(ErrorCode.INVALID_REQUEST, detail)
        header = (headers or api_keys or [None])[0]
        principal = self._keys.authenticate(header.decode("latin-1") if header is not None else None)
        if principal is not None:
            scope["auth"] = principal
            await next_app(scope, receive, send)
            return
        detail = ("missing API key: send `Authorization: Bearer <key>`" if header is None
                  else "unknown API key, or not a `Bearer` authorization")
        if scope["type"] == ScopeType.WEBSOCKET:
            await _refuse_socket(receive, send, detail)
            return
        raise ApiError(ErrorCode.UNAUTHORIZED, detail)


async def _refuse_socket(receive: Receive, send: Send, detail: str) -> None:
    """Accept, send one ``error`` event, close with 4401 (docs/api.md, "WebSocket")."""
    if (await receive())["type"] != "websocket.connect":
        return
    event = ErrorEvent(sequence_number=0, code=ErrorCode.UNAUTHORIZED.value, message=detail)
    accept: WebSocketAcceptEvent = {"type": "websocket.accept", "subprotocol": None, "headers": []}
    text: WebSocketSendEvent = {"type": "websocket.send", "bytes": None,
                                "text": msgspec.json.encode(event).decode()}
    close: WebSocketCloseEvent = {"type": "websocket.close", "reason": None,
                                  "code": 4000 + ERROR_STATUS[ErrorCode.UNAUTHORIZED]}
    for event_out in (accept, text, close):
        await send(event_out)
