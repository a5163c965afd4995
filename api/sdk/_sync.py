"""The blocking SDK: ``Client``, ``Sessions``, ``Session`` and ``Stream``.

    client = Client("http://127.0.0.1:8000", api_key="...")
    session = client.sessions.create(messages=[{"role": "system", "content": "..."}])
    result = session.append(messages=[{"role": "user", "content": "hi"}],
                            generate={"max_tokens": 128})
    with session.stream(text="more", generate={"temperature": 0}) as stream:
        for delta in stream:
            print(delta.text, end="")
    stream.result.usage   # AppendResult of the committed turn

A thin I/O shell over ``_transport``, which builds every request, decides every retry, maps every
error and interprets every stream event for this client and ``AsyncClient`` alike: this module
only sends through ``httpx.Client`` and websockets' sync client, and sleeps between retries.
Neither this module nor ``_async`` imports the other. Why two shells over one sans-IO core
rather than a sync wrapper around the async client: docs/decisions.md.

Imports only httpx, websockets, msgspec, the standard library, ``phloem.api.schemas`` and the
SDK's own modules (never torch, never the server), so it installs anywhere. Arguments are
validated against the wire schemas before anything is sent; responses and events are decoded
into them. Retries and idempotency: ``_transport`` and docs/api.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import httpx
import websockets.exceptions
from msgspec import UNSET, UnsetType
from websockets.sync.client import ClientConnection, connect

from phloem.api.schemas import AppendResult, DeltaEvent, GenerateParams, ServerEvent, SessionInfo, Turn
from phloem.api.sdk import _transport
from phloem.api.sdk._transport import GenerateArg, MessagesArg, ToolsArg, Transport

__all__ = ["Client", "Session", "Sessions", "Stream"]

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
        retrying = _transport.Retrying(call, self._retry)
        while True:
            request = self._http.build_request(**_transport.request_args(call, self._headers))
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = retrying.after_disconnect(exc)
            else:
                if response.status_code < 400:
                    return response
                body = response.read()
                response.close()
                delay = retrying.after_error(response.status_code, body,
                                             response.headers.get("Retry-After"))
            time.sleep(delay)

    def _send(self, call: _transport.Call[T]) -> T:
        response = self._request(call)
        return call.decode(response.content)

    def _connect_ws(self, session_id: str) -> ClientConnection:
        url, options = _transport.ws_connect_args(str(self._http.base_url), session_id,
                                                  self._headers, self._timeout)
        try:
            return connect(url, **options)
        except _transport.WS_CONNECT_ERRORS as exc:
            raise _transport.ws_connect_error(url, exc) from exc


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
            if (after := _transport.next_cursor(page)) is None:
                return sessions

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
        return Stream(self._client, _transport.StreamState(self.id, request, transport,
                                                           idempotency_key))

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


class Stream:
    """The deltas of one streamed generation; iterate once, or use as a context manager.

    The request is sent on first use (``with`` or the first iteration), so errors the server
    answers before streaming (404, 409, 429 after retries) are raised there; an ``error`` event
    raises the same exception type mid-stream. The SSE request is retried like any call until
    its response starts; once events flow nothing is retried. The WebSocket transport opens one
    connection per stream.

    Leaving early (``break``, an exception, ``close``) cancels the generation on the server,
    which commits what it generated so far. ``cancel`` on the ``"websocket"`` transport stops
    the generation and keeps iterating until its ``done``, so ``result`` is exactly what was
    committed; on ``"sse"`` it closes the connection (``result`` stays None: read
    ``session.turns()`` for what was committed). See docs/api.md, "Cancellation".
    """

    def __init__(self, client: Client, state: _transport.StreamState) -> None:
        self._client = client
        self._state = state
        self._events: Iterator[ServerEvent] | None = None
        self._response: httpx.Response | None = None
        self._ws: ClientConnection | None = None

    @property
    def result(self) -> AppendResult | None:
        """The committed turn, once the ``done`` event arrived."""
        return self._state.result

    def __enter__(self) -> Stream:
        self._start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[DeltaEvent]:
        if self._state.closed:  # cancelled before it started, or already over
            return
        try:
            for event in self._start():
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
            self.close()

    def cancel(self) -> None:
        """Stop the generation; see the class docstring for what each transport then yields."""
        if self._ws is not None and not self._state.closed:
            self._ws.send(_transport.cancel_message())
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (cancelling the generation if it still runs)."""
        self._state.closed = True
        if self._response is not None:
            self._response.close()
        if self._ws is not None:
            self._ws.close()

    def _start(self) -> Iterator[ServerEvent]:
        if self._events is None:
            if self._state.transport == "websocket":
                self._ws = self._client._connect_ws(self._state.session_id)
                # A server that refuses the session sends an error event and closes at once;
                # the failed send is then ignored so that the event is read and raised.
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    self._ws.send(_transport.append_message(self._state.request))
                self._events = _ws_events(self._ws, self._client._timeout)
            else:
                self._response = self._client._request(self._state.call(), stream=True)
                self._events = _sse_events(self._response)
        return self._events


def _ws_events(ws: ClientConnection, timeout: float) -> Iterator[ServerEvent]:
    while True:
        yield _transport.decode_ws_event(ws.recv(timeout=timeout))


def _sse_events(response: httpx.Response) -> Iterator[ServerEvent]:
    decoder = _transport.SSEDecoder()
    for line in response.iter_lines():
        yield from decoder.feed(line)
