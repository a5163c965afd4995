"""The asyncio SDK: ``AsyncClient``, ``AsyncSessions``, ``AsyncSession`` and ``AsyncStream``.

Every method has the blocking method's arguments, return value and errors (documented in
``_sync``), as a coroutine. Like ``_sync``, a thin I/O shell over ``_transport`` (requests,
retry decisions, error mapping and stream events are handled there, once for both clients):
this module only sends through ``httpx.AsyncClient`` and websockets' asyncio client, and sleeps
between retries. Neither this module nor ``_sync`` imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx
import websockets.exceptions
from msgspec import UNSET, UnsetType
from websockets.asyncio.client import ClientConnection, connect

from phloem.api.schemas import AppendResult, DeltaEvent, GenerateParams, ServerEvent, SessionInfo, Turn
from phloem.api.sdk import _transport
from phloem.api.sdk._transport import GenerateArg, MessagesArg, ToolsArg, Transport

__all__ = ["AsyncClient", "AsyncSession", "AsyncSessions", "AsyncStream"]

T = TypeVar("T")


class AsyncClient:
    """An asyncio client of a Phloem server; arguments as for ``Client``.

    Args:
        base_url: The server root, without ``/v1``.
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        timeout: Seconds to wait for a response (or the next stream event).
        max_retries: Retries of a failed call that is safe to repeat.
        http_client: An ``httpx.AsyncClient`` to send through (not closed by ``aclose``).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float = 600.0, max_retries: int = 2,
                 http_client: httpx.AsyncClient | None = None) -> None:
        self._headers = _transport.base_headers(api_key)
        self._timeout = timeout
        self._retry = _transport.RetryPolicy(max_retries)
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(base_url=base_url,
                                                      timeout=_transport.http_timeout(timeout))
        self.sessions = AsyncSessions(self)

    async def aclose(self) -> None:
        """Close the connection pool (unless it was passed in as ``http_client``)."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _request(self, call: _transport.Call[Any], *, stream: bool = False) -> httpx.Response:
        """Send ``call`` with retries; return the first successful response (open if streamed)."""
        retrying = _transport.Retrying(call, self._retry)
        while True:
            request = self._http.build_request(**_transport.request_args(call, self._headers))
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = retrying.after_disconnect(exc)
            else:
                if response.status_code < 400:
                    return response
                body = await response.aread()
                await response.aclose()
                delay = retrying.after_error(response.status_code, body,
                                             response.headers.get("Retry-After"))
            await asyncio.sleep(delay)

    async def _send(self, call: _transport.Call[T]) -> T:
        response = await self._request(call)
        return call.decode(response.content)

    async def _connect_ws(self, session_id: str) -> ClientConnection:
        url, options = _transport.ws_connect_args(str(self._http.base_url), session_id,
                                                  self._headers, self._timeout)
        try:
            return await connect(url, **options)
        except _transport.WS_CONNECT_ERRORS as exc:
            raise _transport.ws_connect_error(url, exc) from exc


class AsyncSessions:
    """``client.sessions`` of an ``AsyncClient`` (see ``Sessions``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, metadata: Mapping[str, str] | None = None, ttl: float | None = None,
                     input_ids: Sequence[int] | None = None, messages: MessagesArg | None = None,
                     text: str | None = None, tools: ToolsArg | None = None,
                     idempotency_key: str | None = None) -> AsyncSession:
        """Create a session (see ``Sessions.create``)."""
        fields = {"metadata": metadata or {}, "ttl": ttl, "input_ids": input_ids,
                  "messages": messages, "text": text, "tools": tools}
        info = await self._client._send(_transport.create_session(fields, idempotency_key))
        return AsyncSession(self._client, info)

    async def get(self, session_id: str) -> AsyncSession:
        """Look a session up (see ``Sessions.get``)."""
        info = await self._client._send(_transport.get_session(session_id))
        return AsyncSession(self._client, info)

    async def list(self, *, parent_id: str | None = None,
                   page_size: int = 100) -> list[AsyncSession]:
        """Every session of this API key, newest first (see ``Sessions.list``)."""
        sessions: list[AsyncSession] = []
        after: str | None = None
        while True:
            page = await self._client._send(_transport.list_sessions(page_size, after, parent_id))
            sessions += [AsyncSession(self._client, info) for info in page.sessions]
            if (after := _transport.next_cursor(page)) is None:
                return sessions

    async def delete(self, session_id: str) -> None:
        """Delete a session (see ``Sessions.delete``)."""
        await self._client._send(_transport.delete_session(session_id))


class AsyncSession:
    """A handle on one session of an ``AsyncClient`` (see ``Session``).

    Attributes:
        id: The session id.
        info: The session as last seen.
    """

    def __init__(self, client: AsyncClient, info: SessionInfo) -> None:
        self._client = client
        self.id = info.id
        self.info = info

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, status={self.info.status!r})"

    async def append(self, *, input_ids: Sequence[int] | None = None,
                     messages: MessagesArg | None = None, text: str | None = None,
                     generate: GenerateArg | None = None,
                     idempotency_key: str | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> AppendResult:
        """Append and optionally generate one turn (see ``Session.append``)."""
        fields = {"input_ids": input_ids, "messages": messages, "text": text, "generate": generate,
                  "chat_template_kwargs": chat_template_kwargs}
        request = _transport.append_request(fields, None)
        return await self._client._send(_transport.append(self.id, request, idempotency_key))

    def stream(self, *, input_ids: Sequence[int] | None = None, messages: MessagesArg | None = None,
               text: str | None = None, generate: GenerateArg | None = None,
               transport: Transport = "sse", idempotency_key: str | None = None,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> AsyncStream:
        """Append and stream a generation (see ``Session.stream``); use ``async with``."""
        fields = {"input_ids": input_ids, "messages": messages, "text": text,
                  "generate": GenerateParams() if generate is None else generate,
                  "chat_template_kwargs": chat_template_kwargs}
        request = _transport.append_request(fields, transport)
        return AsyncStream(self._client, _transport.StreamState(self.id, request, transport,
                                                                idempotency_key))

    async def fork(self, n: int = 1, *, at_turn: int | None = None) -> list[AsyncSession]:
        """Fork ``n`` children (see ``Session.fork``)."""
        result = await self._client._send(_transport.fork(self.id, n, at_turn, None))
        return [AsyncSession(self._client, info) for info in result.sessions]

    async def turns(self, *, include_tokens: bool = False) -> list[Turn]:
        """The committed turns, oldest first (see ``Session.turns``)."""
        return (await self._client._send(_transport.turns(self.id, include_tokens))).turns

    async def refresh(self) -> SessionInfo:
        """Fetch the session's current state into ``info`` and return it."""
        self.info = await self._client._send(_transport.get_session(self.id))
        return self.info

    async def update(self, *, metadata: Mapping[str, str] | UnsetType = UNSET,
                     ttl: float | None | UnsetType = UNSET) -> SessionInfo:
        """Replace the metadata and/or the TTL (see ``Session.update``)."""
        call = _transport.update_session(self.id, {"metadata": metadata, "ttl": ttl})
        self.info = await self._client._send(call)
        return self.info

    async def offload(self, tier: Literal["host", "disk"] = "host") -> SessionInfo:
        """Ask the server to spill the session's state to ``tier`` (see ``Session.offload``)."""
        self.info = await self._client._send(_transport.offload(self.id, tier))
        return self.info

    async def prefetch(self) -> SessionInfo:
        """Ask the server to load the session's state back to the GPU."""
        self.info = await self._client._send(_transport.prefetch(self.id))
        return self.info

    async def delete(self) -> None:
        """Delete the session (see ``Sessions.delete``)."""
        await self._client._send(_transport.delete_session(self.id))


class AsyncStream:
    """The asyncio ``Stream``: ``async with`` / ``async for``; ``cancel`` and ``close`` are
    coroutines. Same semantics as ``Stream``."""

    def __init__(self, client: AsyncClient, state: _transport.StreamState) -> None:
        self._client = client
        self._state = state
        self._events: AsyncIterator[ServerEvent] | None = None
        self._response: httpx.Response | None = None
        self._ws: ClientConnection | None = None

    @property
    def result(self) -> AppendResult | None:
        """The committed turn, once the ``done`` event arrived."""
        return self._state.result

    async def __aenter__(self) -> AsyncStream:
        await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def __aiter__(self) -> AsyncIterator[DeltaEvent]:
        if self._state.closed:  # cancelled before it started, or already over
            return
        try:
            async for event in await self._start():
                delta = self._state.accept(event)
                if delta is not None:
                    yield delta
                elif self._state.result is not None:
                    return
        except _transport.STREAM_BROKEN as exc:
            if (error := self._state.broken(exc)) is not None:
                raise error from exc
        else:
            if (error := self._state.ended()) is not None:
                raise error
        finally:
            await self.close()

    async def cancel(self) -> None:
        """Stop the generation (see ``Stream.cancel``)."""
        if self._ws is not None and not self._state.closed:
            await self._ws.send(_transport.cancel_message())
        else:
            await self.close()

    async def close(self) -> None:
        """Close the connection (cancelling the generation if it still runs)."""
        self._state.closed = True
        if self._response is not None:
            await self._response.aclose()
        if self._ws is not None:
            await self._ws.close()

    async def _start(self) -> AsyncIterator[ServerEvent]:
        if self._events is None:
            if self._state.transport == "websocket":
                self._ws = await self._client._connect_ws(self._state.session_id)
                # See ``Stream._start``: a refused session's error event is read, not lost.
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    await self._ws.send(_transport.append_message(self._state.request))
                self._events = _ws_events(self._ws, self._client._timeout)
            else:
                self._response = await self._client._request(self._state.call(), stream=True)
                self._events = _sse_events(self._response)
        return self._events


async def _ws_events(ws: ClientConnection, timeout: float) -> AsyncIterator[ServerEvent]:
    while True:
        async with asyncio.timeout(timeout):
            frame = await ws.recv()
        yield _transport.decode_ws_event(frame)


async def _sse_events(response: httpx.Response) -> AsyncIterator[ServerEvent]:
    decoder = _transport.SSEDecoder()
    async for line in response.aiter_lines():
        for event in decoder.feed(line):
            yield event
