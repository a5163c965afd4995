"""``Stream`` and ``AsyncStream``: the deltas of one streamed generation, over SSE or WebSocket.

A stream sends its request on first use (``with``/``async with`` or the first iteration), so
errors the server answers before streaming (404, 409, 429 after retries) are raised there; an
``error`` event raises the same exception type mid-stream. The SSE request is retried like any
call until its response starts; once events flow nothing is retried. The WebSocket transport
opens one connection per stream; its ``cancel`` is exact (docs/api.md, "Cancellation").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Literal

import httpx
import websockets.exceptions

from phloem.api import _transport
from phloem.api._errors import APIConnectionError
from phloem.api.schemas import AppendRequest, AppendResult, DeltaEvent, ServerEvent

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection as AsyncConnection
    from websockets.sync.client import ClientConnection

    from phloem.api._client_async import AsyncClient
    from phloem.api.client import Client

__all__ = ["AsyncStream", "Stream", "Transport"]

Transport = Literal["sse", "websocket"]
_BROKEN = (httpx.TransportError, httpx.StreamClosed, TimeoutError,
           websockets.exceptions.ConnectionClosed)


class Stream:
    """The deltas of one streamed generation; iterate once, or use as a context manager.

    Leaving early (``break``, an exception, ``close``) cancels the generation on the server,
    which commits what it generated so far. ``cancel`` on the ``"websocket"`` transport stops
    the generation and keeps iterating until its ``done``, so ``result`` is exactly what was
    committed; on ``"sse"`` it closes the connection (``result`` stays None: read
    ``session.turns()`` for what was committed).

    Attributes:
        result: The committed turn, once the ``done`` event arrived.
    """

    def __init__(self, client: Client, session_id: str, request: AppendRequest,
                 transport: Transport, idempotency_key: str | None) -> None:
        self._client = client
        self._session_id = session_id
        self._request = request
        self._transport = transport
        self._key = idempotency_key
        self._events: Iterator[ServerEvent] | None = None
        self._response: httpx.Response | None = None
        self._ws: ClientConnection | None = None
        self._closed = False
        self.result: AppendResult | None = None

    def __enter__(self) -> Stream:
        self._start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[DeltaEvent]:
        if self._closed:  # cancelled before it started, or already over
            return
        try:
            for event in self._start():
                item = _transport.settle(event)
                if isinstance(item, DeltaEvent):
                    yield item
                elif item is not None:
                    self.result = item
                    return
        except _BROKEN as exc:
            if not self._closed:
                raise APIConnectionError(f"the stream broke: {exc!r}") from exc
        else:
            if not self._closed:
                raise APIConnectionError("the stream ended before its `done` event")
        finally:
            self.close()

    def cancel(self) -> None:
        """Stop the generation; see the class docstring for what each transport then yields."""
        if self._ws is not None and not self._closed:
            self._ws.send(_transport.cancel_message())
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (cancelling the generation if it still runs)."""
        self._closed = True
        if self._response is not None:
            self._response.close()
        if self._ws is not None:
            self._ws.close()

    def _start(self) -> Iterator[ServerEvent]:
        if self._events is None:
            if self._transport == "websocket":
                self._ws = self._client._connect_ws(self._session_id)
                # A server that refuses the session sends an error event and closes at once;
                # the failed send is then ignored so that the event is read and raised.
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    self._ws.send(_transport.append_message(self._request))
                self._events = _ws_events(self._ws, self._client._timeout)
            else:
                call = _transport.append(self._session_id, self._request, self._key)
                self._response = self._client._request(call, stream=True)
                self._events = _sse_events(self._response)
        return self._events


class AsyncStream:
    """The asyncio ``Stream``: ``async with`` / ``async for``; ``cancel`` and ``close`` are
    coroutines. Same semantics as ``Stream``.

    Attributes:
        result: The committed turn, once the ``done`` event arrived.
    """

    def __init__(self, client: AsyncClient, session_id: str, request: AppendRequest,
                 transport: Transport, idempotency_key: str | None) -> None:
        self._client = client
        self._session_id = session_id
        self._request = request
        self._transport = transport
        self._key = idempotency_key
        self._events: AsyncIterator[ServerEvent] | None = None
        self._response: httpx.Response | None = None
        self._ws: AsyncConnection | None = None
        self._closed = False
        self.result: AppendResult | None = None

    async def __aenter__(self) -> AsyncStream:
        await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def __aiter__(self) -> AsyncIterator[DeltaEvent]:
        if self._closed:  # cancelled before it started, or already over
            return
        try:
            async for event in await self._start():
                item = _transport.settle(event)
                if isinstance(item, DeltaEvent):
                    yield item
                elif item is not None:
                    self.result = item
                    return
        except _BROKEN as exc:
            if not self._closed:
                raise APIConnectionError(f"the stream broke: {exc!r}") from exc
        else:
            if not self._closed:
                raise APIConnectionError("the stream ended before its `done` event")
        finally:
            await self.close()

    async def cancel(self) -> None:
        """Stop the generation (see ``Stream.cancel``)."""
        if self._ws is not None and not self._closed:
            await self._ws.send(_transport.cancel_message())
        else:
            await self.close()

    async def close(self) -> None:
        """Close the connection (cancelling the generation if it still runs)."""
        self._closed = True
        if self._response is not None:
            await self._response.aclose()
        if self._ws is not None:
            await self._ws.close()

    async def _start(self) -> AsyncIterator[ServerEvent]:
        if self._events is None:
            if self._transport == "websocket":
                self._ws = await self._client._connect_ws(self._session_id)
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    await self._ws.send(_transport.append_message(self._request))
                self._events = _async_ws_events(self._ws, self._client._timeout)
            else:
                call = _transport.append(self._session_id, self._request, self._key)
                self._response = await self._client._request(call, stream=True)
                self._events = _async_sse_events(self._response)
        return self._events


def _ws_events(ws: ClientConnection, timeout: float) -> Iterator[ServerEvent]:
    while True:
        yield _transport.decode_ws_event(ws.recv(timeout=timeout))


def _sse_events(response: httpx.Response) -> Iterator[ServerEvent]:
    decoder = _transport.SSEDecoder()
    for line in response.iter_lines():
        yield from decoder.feed(line)


async def _async_ws_events(ws: AsyncConnection, timeout: float) -> AsyncIterator[ServerEvent]:
    while True:
        async with asyncio.timeout(timeout):
            frame = await ws.recv()
        yield _transport.decode_ws_event(frame)


async def _async_sse_events(response: httpx.Response) -> AsyncIterator[ServerEvent]:
    decoder = _transport.SSEDecoder()
    async for line in response.aiter_lines():
        for event in decoder.feed(line):
            yield event
