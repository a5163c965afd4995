"""``GET /v1/sessions/{id}/ws``: the session's WebSocket (docs/api.md, "WebSocket").

One JSON object per text frame both ways. Client messages (``append``, ``cancel``, ``fork``) are
handled in order by one receive loop; a generation's events are sent by its own forwarding task,
so a ``cancel`` or ``fork`` can arrive while it runs. Every event carries the connection's next
``sequence_number`` (one counter and one send lock per connection) and the ``request_id`` of
the message that caused it.

Errors are ``error`` events and the socket stays open, except when the session does not exist
for the caller's key (at the handshake, or deleted later, seen within a second even with nothing
running): one ``error`` event, then close with ``4404`` (``AuthMiddleware`` refuses a bad key
the same way with ``4401``). ``cancel`` stops this connection's generation, waits for its
``done`` (the partial output is committed) and then answers ``cancelled``. A client that closes
the socket cancels its generation the same way, and so does a generation that produces nothing
for the idle timeout (``pacing``). A socket with no generation running that receives nothing for
the idle timeout is closed with 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from litestar import WebSocket, websocket

from phloem.api.schemas import (
    ERROR_STATUS, AppendMessage, CancelledEvent, CancelMessage, ClientMessage, ErrorCode,
    ErrorEvent, ForkedEvent, ForkMessage, ServerEvent,
)
from phloem.api.server.context import ApiContext, checked_session_id, error_event, owner_of
from phloem.api.server.errors import ApiError, classify, malformed_json
from phloem.api.server.convert import done_event
from phloem.api.server.native import convert
from phloem.sessions import Generation, SessionError, SessionNotFound

__all__ = ["session_socket"]

logger = logging.getLogger(__name__)
_decoder = msgspec.json.Decoder(ClientMessage)
# Seconds between two checks, while no message arrives, that the session still exists.
_DELETED_POLL_S = 1.0


class _Closed(Exception):
    """The socket is closed (by the client, or by us after a fatal error)."""


class _Idle(Exception):
    """Nothing was received and nothing ran for the idle timeout."""


class _Connection:
    def __init__(self, socket: WebSocket[Any, Any, Any], ctx: ApiContext, session_id: str) -> None:
        self._socket = socket
        self._ctx = ctx
        self._session_id = session_id
        self._owner = owner_of(socket)
        self._seq = 0
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._generation: Generation | None = None
        self._forwarder: asyncio.Task[None] | None = None
        # Loop time of the last message received or event sent (the idle timeout's origin).
        self._last_active = asyncio.get_running_loop().time()

    async def run(self) -> None:
        await self._socket.accept()
        try:
            self._ctx.manager.get(self._owner, checked_session_id(self._session_id))
            while True:
                message = await self._receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self._handle(message)
        except (SessionNotFound, ApiError) as exc:
            await self._fatal(exc, None)
        except _Idle:
            await self._close(1000, "idle")
        except _Closed:
            pass
        finally:
            self._closed = True
            if self._generation is not None:
                self._generation.cancel()

    async def _receive(self) -> Any:
        """The next client message; raises ``_Idle`` after the idle timeout with nothing running,
        and ``SessionNotFound`` within ``_DELETED_POLL_S`` of the session's deletion (a socket
        with no generation running learns of it no other way)."""
        loop = asyncio.get_running_loop()
        while True:
            idle_left = self._last_active + self._ctx.stream_idle_timeout_s - loop.time()
            if idle_left <= 0 and self._generation is None:
                raise _Idle
            wait_s = min(_DELETED_POLL_S, max(idle_left, self._ctx.stream_idle_timeout_s / 10))
            try:
                message = await asyncio.wait_for(self._socket.receive(), wait_s)
            except TimeoutError:
                self._ctx.manager.get(self._owner, self._session_id)
                continue
            self._last_active = loop.time()
            return message

    async def _handle(self, message: Any) -> None:
        text = message.get("text")
        if text is None:
            await self._error(ErrorCode.INVALID_REQUEST, "expected a text frame holding JSON", None)
            return
        try:
            request = _decoder.decode(text)
        except msgspec.ValidationError as exc:
            await self._error(ErrorCode.INVALID_REQUEST, str(exc), None)
            return
        except msgspec.DecodeError as exc:
            await self._error(ErrorCode.INVALID_REQUEST, malformed_json(str(exc), "message"), None)
            return
        try:
            if isinstance(request, AppendMessage):
                await self._append(request)
            elif isinstance(request, CancelMessage):
                await self._cancel(request.request_id)
            else:
                await self._fork(request)
        except SessionNotFound:
            raise
        except (SessionError, ApiError) as exc:
            await self._send(error_event(exc, 0, request.request_id))

    async def _append(self, message: AppendMessage) -> None:
        async def start() -> Generation:
            return await self._ctx.manager.append(
                self._owner, self._session_id,
                convert.session_input(message.input_ids, message.text, message.messages,
                                       message.chat_template_kwargs),
                convert.generate_options(message.generate))
        if message.generate is None:
            generation = await start()
        else:
            generation = await self._ctx.start_generation(self._owner, start)
        self._generation = generation
        self._forwarder = asyncio.ensure_future(self._forward(generation, message.request_id))

    async def _forward(self, generation: Generation, request_id: str | None) -> None:
        try:
            async for delta in self._ctx.paced(generation):
                # A delta that only closes the parsed parts carries no text for this protocol.
                if delta is not None and (delta.text or delta.token_ids):
                    await self._send(convert.delta_event(delta, 0, request_id))
            try:
                result = convert.append_result(await generation.result())
            except SessionNotFound as exc:
                await self._fatal(exc, request_id)
                return
            except SessionError as exc:
                await self._send(error_event(exc, 0, request_id))
                return
            await self._send(done_event(result, 0, request_id))
        except _Closed:
            generation.cancel()
        finally:
            if self._generation is generation:
                self._generation = None

    async def _cancel(self, request_id: str | None) -> None:
        generation, forwarder = self._generation, self._forwarder
        if generation is not None and forwarder is not None:
            generation.cancel()
            # The generation's remaining deltas and its `done` go out before `cancelled`.
            with contextlib.suppress(_Closed):
                await asyncio.shield(forwarder)
        await self._send(CancelledEvent(sequence_number=0, request_id=request_id))

    async def _fork(self, message: ForkMessage) -> None:
        with self._ctx.limits.creating_sessions(self._owner, message.n):
            children = await self._ctx.manager.fork(self._owner, self._session_id, message.n,
                                                    message.at_turn)
        await self._send(ForkedEvent(sequence_number=0, request_id=message.request_id,
                                     sessions=[convert.session_info(c) for c in children]))

    async def _error(self, code: ErrorCode, message: str, request_id: str | None) -> None:
        await self._send(ErrorEvent(sequence_number=0, code=code.value, message=message,
                                    request_id=request_id))

    async def _fatal(self, exc: SessionError | ApiError, request_id: str | None) -> None:
        """Send the error event, then close with ``4000 + status`` (e.g. 4404)."""
        code = classify(exc)[0]
        with contextlib.suppress(_Closed):
            await self._send(error_event(exc, 0, request_id))
        await self._close(4000 + ERROR_STATUS[code])

    async def _close(self, code: int, reason: str = "") -> None:
        async with self._send_lock:
            if not self._closed:
                self._closed = True
                with contextlib.suppress(Exception):
                    await self._socket.close(code=code, reason=reason)

    async def _send(self, event: ServerEvent) -> None:
        """Send ``event`` with the connection's next sequence number."""
        async with self._send_lock:
            if self._closed:
                raise _Closed
            event = msgspec.structs.replace(event, sequence_number=self._seq)
            try:
                await self._socket.send_text(msgspec.json.encode(event).decode())
            except Exception as exc:
                # The peer went away between its last frame and this send.
                self._closed = True
                raise _Closed from exc
            self._seq += 1
            self._last_active = asyncio.get_running_loop().time()


@websocket("/v1/sessions/{session_id:str}/ws")
async def session_socket(socket: WebSocket[Any, Any, Any], session_id: str,
                         ctx: ApiContext) -> None:
    """The session's WebSocket: append/cancel/fork messages in, streamed events out."""
    await _Connection(socket, ctx, session_id).run()
