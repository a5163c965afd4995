"""The Python SDK of the native API: ``Client`` (sync) and ``AsyncClient`` (asyncio).

    client = Client("http://127.0.0.1:8000", api_key="...")
    session = client.sessions.create(messages=[{"role": "system", "content": "..."}])
    result = session.append(messages=[{"role": "user", "content": "hi"}],
                            generate={"max_tokens": 128})
    with session.stream(text="more", generate={"temperature": 0}) as stream:
        for delta in stream:
            print(delta.text, end="")
    stream.result.usage   # AppendResult of the committed turn

Imports only httpx, websockets, msgspec, the standard library, ``phloem.api.schemas`` and its
own private modules (never torch, never another phloem package), so it installs anywhere.
Arguments are validated against the wire schemas before anything is sent; responses and events
are decoded into them. Retries and idempotency: ``phloem.api._transport`` and docs/api.md.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx
import websockets.exceptions
from msgspec import UNSET, UnsetType
from websockets.sync.client import ClientConnection, connect

from phloem.api import _transport
from phloem.api._client_async import AsyncClient, AsyncSession, AsyncSessions
from phloem.api._errors import (
    APIConnectionError, ContextLengthExceeded, Forbidden, IdempotencyConflict, InternalError,
    InvalidRequest, NotFound, Overloaded, PayloadTooLarge, PhloemError, RateLimited, SessionBusy,
    SessionNotFound, Unauthorized, error_from_response,
)
from phloem.api._stream import AsyncStream, Stream, Transport
from phloem.api._transport import GenerateArg, MessagesArg, ToolsArg
from phloem.api.schemas import (
    AppendResult, ChatMessage, FunctionCall, GenerateParams, SessionInfo, TokenLogprobs, ToolCall, Turn,
)

__all__ = [
    "APIConnectionError", "AsyncClient", "AsyncSession", "AsyncSessions", "AsyncStream",
    "ChatMessage", "Client", "ContextLengthExceeded", "Forbidden", "FunctionCall", "GenerateParams",
    "IdempotencyConflict", "InternalError", "InvalidRequest", "NotFound", "Overloaded",
    "PayloadTooLarge", "PhloemError", "RateLimited", "Session", "SessionBusy", "SessionNotFound",
    "Sessions", "Stream", "TokenLogprobs", "ToolCall", "Unauthorized",
]

T = TypeVar("T")


class Client:
    """A synchronous client of a Phloem server.

    Args:
        base_url: The server root, without ``/v1``.
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        timeout: Seconds to wait for a response (or the next stream event); connecting waits at
            most 10 s.
        max_retries: Retries of a failed call (429/503 honouring ``Retry-After``, 408/502/504,
            connection errors); only calls safe to repeat are retried.
        http_client: An httpx client to send through instead of a new one (its ``base_url`` is
            used; e.g. Litestar's ``TestClient``). It is not closed by ``close``.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2,
                 http_client: httpx.Client | None = None) -> None:
        self._headers = _transport.base_headers(api_key)
        self._timeout = timeout
        self._retry = _transport.RetryPolicy(max_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(base_url=base_url,
                                                 timeout=_transport.http_timeout(timeout))
        self.sessions = Sessions(self)

    def close(self) -> None:
        """Close the connection pool (unless it was passed in as ``http_client``)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, call: _transport.Call[Any], *, stream: bool = False) -> httpx.Response:
        """Send ``call`` with retries; return the first successful response (open if streamed)."""
        attempt = 0
        while True:
            request = self._http.build_request(call.method, call.path, content=call.body,
                                               params=call.params,
                                               headers={**self._headers, **call.headers})
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self._retry.delay(call, attempt, None, None)
                if delay is None:
                    raise APIConnectionError(f"{call.method} {call.path}: {exc!r}") from exc
            else:
                if response.status_code < 400:
                    return response
                body = response.read()
                response.close()
                retry_after = response.headers.get("Retry-After")
                delay = self._retry.delay(call, attempt, response.status_code, retry_after)
                if delay is None:
                    raise error_from_response(response.status_code, body, retry_after)
            time.sleep(delay)
            attempt += 1

    def _send(self, call: _transport.Call[T]) -> T:
        response = self._request(call)
        return call.decode(response.content)

    def _connect_ws(self, session_id: str) -> ClientConnection:
        url = _transport.ws_url(str(self._http.base_url), session_id)
        try:
            return connect(url, additional_headers=self._headers, user_agent_header=None,
                           open_timeout=min(self._timeout, 10.0), max_size=2**24)
        except websockets.exceptions.InvalidStatus as exc:
            response = exc.response
            raise error_from_response(response.status_code, bytes(response.body or b""),
                                      response.headers.get("Retry-After")) from exc
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            raise APIConnectionError(f"WebSocket {url}: {exc!r}") from exc


class Sessions:
    """``client.sessions``: create, look up, list and delete sessions."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, metadata: Mapping[str, str] | None = None, ttl: float | None = None,
               input_ids: Sequence[int] | None = None, messages: MessagesArg | None = None,
               text: str | None = None, tools: ToolsArg | None = None,
               idempotency_key: str | None = None) -> Session:
        """Create a session, optionally with initial content committed as turn 0.

        Args:
            metadata: Up to 16 string labels.
            ttl: Seconds the session stays pinned after a turn; None: the server default.
            input_ids: Initial token ids (at most one of input_ids, messages, text).
            messages: Initial chat messages, rendered with the model's chat template.
            text: Initial raw text (special-token strings are recognised).
            tools: Tool definitions for the chat template (only with ``messages``).
            idempotency_key: Reuse a key to make a repeated create return the same session.

        Returns:
            A handle on the new session.

        Raises:
            InvalidRequest: An argument breaks the schema, or the input does not fit the context.
            PhloemError: Any other error answer (see docs/api.md).
        """
        fields = {"metadata": metadata or {}, "ttl": ttl, "input_ids": input_ids,
                  "messages": messages, "text": text, "tools": tools}
        info = self._client._send(_transport.create_session(fields, idempotency_key))
        return Session(self._client, info)

    def get(self, session_id: str) -> Session:
        """Look a session up.

        Raises:
            SessionNotFound: No such session belongs to this API key.
        """
        return Session(self._client, self._client._send(_transport.get_session(session_id)))

    def list(self, *, parent_id: str | None = None, page_size: int = 100) -> list[Session]:
        """Every session of this API key, newest first (all pages are fetched).

        Args:
            parent_id: Only the children forked from this session.
            page_size: Sessions per request (1..100).

        Returns:
            Handles on the sessions.
        """
        sessions: list[Session] = []
        after: str | None = None
        while True:
            page = self._client._send(_transport.list_sessions(page_size, after, parent_id))
            sessions += [Session(self._client, info) for info in page.sessions]
            if not page.has_more or not page.sessions:
                return sessions
            after = page.sessions[-1].id

    def delete(self, session_id: str) -> None:
        """Delete a session, cancelling its generation in flight; forks of it are unaffected.

        Raises:
            SessionNotFound: No such session belongs to this API key.
        """
        self._client._send(_transport.delete_session(session_id))


class Session:
    """A handle on one session.

    Attributes:
        id: The session id.
        info: The session as last seen (by create, get, refresh, update, offload, prefetch);
            not refreshed by ``append``.
    """

    def __init__(self, client: Client, info: SessionInfo) -> None:
        self._client = client
        self.id = info.id
        self.info = info

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, status={self.info.status!r})"

    def append(self, *, input_ids: Sequence[int] | None = None, messages: MessagesArg | None = None,
               text: str | None = None, generate: GenerateArg | None = None,
               idempotency_key: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> AppendResult:
        """Append input and, if ``generate`` is given, generate; the result is one new turn.

        Args:
            input_ids: New token ids (at most one of input_ids, messages, text).
            messages: New chat messages; with ``generate`` the assistant prompt is added.
            text: New raw text.
            generate: Sampling parameters; None: only append. With no input, generation
                continues from the session's last token. ``tool_choice``,
                ``response_format`` and the penalties go here too.
            idempotency_key: Reuse a key to make a repeated append return the first result.
            chat_template_kwargs: Extra chat-template variables for ``messages``
                (``{"enable_thinking": False}``).

        Returns:
            The committed turn: its index, output ids and text, finish reason and usage; its
            ``content``, ``reasoning_content`` and ``tool_calls`` (typed ``ToolCall`` objects).

        Raises:
            InvalidRequest: Bad arguments. ContextLengthExceeded: the input does not fit.
            SessionBusy: A generation already runs on this session.
            SessionNotFound: The session was deleted.
        """
        fields = {"input_ids": input_ids, "messages": messages, "text": text, "generate": generate,
                  "chat_template_kwargs": chat_template_kwargs}
        request = _transport.append_request(fields, None)
        return self._client._send(_transport.append(self.id, request, idempotency_key))

    def stream(self, *, input_ids: Sequence[int] | None = None, messages: MessagesArg | None = None,
               text: str | None = None, generate: GenerateArg | None = None,
               transport: Transport = "sse", idempotency_key: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> Stream:
        """Append and generate, streaming the output (the request is sent on first use).

        Args:
            input_ids: New token ids (at most one of input_ids, messages, text).
            messages: New chat messages (the assistant prompt is added).
            text: New raw text.
            generate: Sampling parameters; None: the server defaults.
            transport: ``"sse"`` (HTTP) or ``"websocket"`` (exact cancel, see ``Stream.cancel``).
            idempotency_key: For ``"sse"``: reuse a key to replay a finished stream.
            chat_template_kwargs: Extra chat-template variables for ``messages``.

        Returns:
            A ``Stream`` of ``DeltaEvent``; ``stream.result`` holds the turn once it is done.

        Raises:
            InvalidRequest: Bad arguments (raised here; server errors are raised on first use).
        """
        fields = {"input_ids": input_ids, "messages": messages, "text": text,
                  "generate": GenerateParams() if generate is None else generate,
                  "chat_template_kwargs": chat_template_kwargs}
        request = _transport.append_request(fields, transport)
        return Stream(self._client, self.id, request, transport, idempotency_key)

    def fork(self, n: int = 1, *, at_turn: int | None = None) -> list[Session]:
        """Fork ``n`` children sharing this session's committed turns ``0..at_turn`` (default all).

        Raises:
            InvalidRequest: ``at_turn`` is not a committed turn, or ``n`` is out of 1..64.
        """
        result = self._client._send(_transport.fork(self.id, n, at_turn, None))
        return [Session(self._client, info) for info in result.sessions]

    def turns(self, *, include_tokens: bool = False) -> list[Turn]:
        """The committed turns, oldest first (inherited turns of a fork included).

        Args:
            include_tokens: Also return each turn's token ids.
        """
        return self._client._send(_transport.turns(self.id, include_tokens)).turns

    def refresh(self) -> SessionInfo:
        """Fetch the session's current state into ``info`` and return it."""
        self.info = self._client._send(_transport.get_session(self.id))
        return self.info

    def update(self, *, metadata: Mapping[str, str] | UnsetType = UNSET,
               ttl: float | None | UnsetType = UNSET) -> SessionInfo:
        """Replace the metadata and/or the TTL (``ttl=None``: the server default)."""
        call = _transport.update_session(self.id, {"metadata": metadata, "ttl": ttl})
        self.info = self._client._send(call)
        return self.info

    def offload(self, tier: Literal["host", "disk"] = "host") -> SessionInfo:
        """Ask the server to spill the session's state to ``tier`` now (asynchronously)."""
        self.info = self._client._send(_transport.offload(self.id, tier))
        return self.info

    def prefetch(self) -> SessionInfo:
        """Ask the server to load the session's state back to the GPU now (asynchronously)."""
        self.info = self._client._send(_transport.prefetch(self.id))
        return self.info

    def delete(self) -> None:
        """Delete the session (see ``Sessions.delete``)."""
        self._client._send(_transport.delete_session(self.id))
