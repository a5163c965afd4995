"""The SDK without I/O: what ``Client`` and ``AsyncClient`` share, written once.

Every SDK method builds a ``Call`` here (route, validated body, headers, result type); the
``Client`` (``_sync``) and ``AsyncClient`` (``_async``) only send it, so both speak exactly the
same wire contract. The same goes for everything that is not I/O: retry decisions and error
mapping (``Retrying``), WebSocket connect options and failures, SSE and WebSocket decoding, and
what a stream does with each event (``StreamState``). The two clients are thin I/O shells over
this module, one over ``httpx.Client`` and websockets' sync client, the other over
``httpx.AsyncClient`` and its asyncio client; neither imports the other. Why not a sync wrapper
around the async client: docs/decisions.md ("The sync SDK client ...").

Retry policy (docs/api.md, "Retries"): a call is retried at most ``max_retries`` times when the
server answers 408, 429, 502, 503 or 504 or the connection fails, and only if it is safe to
repeat: a GET, or a request that carries an ``Idempotency-Key`` (every POST, PATCH and DELETE of
the SDK does, and the key stays the same across the retries of one call). A ``Retry-After`` is
honoured exactly; without one the delay is exponential with jitter. A ``Retry-After`` longer than
``MAX_RETRY_DELAY`` is not waited out: the error is raised at once.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, cast
from urllib.parse import quote

import httpx
import msgspec
import websockets.exceptions

from phloem import __version__
from phloem.api.schemas import (
    AppendMessage, AppendRequest, AppendResult, CancelMessage, ChatMessage, CreateSessionRequest,
    DeltaEvent, DoneEvent, ErrorEvent, ForkRequest, ForkResult, GenerateParams, OffloadRequest,
    ServerEvent, SessionInfo, SessionList, StreamEvent, Tool, TurnList, UpdateSessionRequest,
)
from phloem.api.sdk._errors import (
    APIConnectionError, InvalidRequest, PhloemError, error_from_event, error_from_response,
    parse_retry_after,
)

__all__ = [
    "MAX_RETRY_DELAY", "STREAM_BROKEN", "USER_AGENT", "WS_CONNECT_ERRORS", "Call", "GenerateArg",
    "MessagesArg", "RetryPolicy", "Retrying", "SSEDecoder", "StreamState", "ToolsArg", "Transport",
    "append", "append_message", "append_request", "base_headers", "cancel_message",
    "create_session", "decode_ws_event", "delete_session", "fork", "get_session", "http_timeout",
    "list_sessions", "next_cursor", "offload", "prefetch", "request_args", "settle", "turns",
    "update_session", "ws_connect_args", "ws_connect_error", "ws_url",
]

T = TypeVar("T")
MessagesArg = Sequence[ChatMessage | Mapping[str, Any]]
GenerateArg = GenerateParams | Mapping[str, Any]
ToolsArg = Sequence[Tool | Mapping[str, Any]]
S = TypeVar("S")
Transport = Literal["sse", "websocket"]

MAX_RETRY_DELAY = 60.0
# The package's own version: the same in the full install and the SDK-only wheel (phloem-sdk).
USER_AGENT = f"phloem-python/{__version__}"
_RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
WS_CONNECT_ERRORS = (OSError, websockets.exceptions.WebSocketException)
# What breaks a stream once its events flow (then nothing is retried).
STREAM_BROKEN = (httpx.TransportError, httpx.StreamClosed, TimeoutError,
                 websockets.exceptions.ConnectionClosed)
_encoder = msgspec.json.Encoder()
_server_event_decoder = msgspec.json.Decoder(ServerEvent)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One API request: what to send and how to read the answer (``result_type=None``: no body)."""

    method: str
    path: str
    result_type: type[T] | None
    body: bytes | None = None
    params: Mapping[str, str | int] = field(default_factory=dict)
    idempotency_key: str | None = None

    @property
    def retryable(self) -> bool:
        return self.method == "GET" or self.idempotency_key is not None

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if self.body is not None else {}
        if self.idempotency_key is not None:
            headers["Idempotency-Key"] = self.idempotency_key
        return headers

    def decode(self, content: bytes) -> T:
        if self.result_type is None:
            return cast(T, None)
        return msgspec.json.decode(content, type=self.result_type)


def base_headers(api_key: str | None) -> dict[str, str]:
    """Headers of every request: the user agent and, with a key, the bearer token."""
    headers = {"User-Agent": USER_AGENT}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def http_timeout(timeout: float) -> httpx.Timeout:
    """``timeout`` for reads, writes and the pool; connecting waits at most 10 s."""
    return httpx.Timeout(timeout, connect=min(timeout, 10.0))


def request_args(call: Call[Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """The ``build_request`` arguments of ``call`` (the same for ``httpx.Client`` and
    ``httpx.AsyncClient``), with the client's ``headers`` under the call's own."""
    return {"method": call.method, "url": call.path, "content": call.body, "params": call.params,
            "headers": {**headers, **call.headers}}


def _validated(kind: type[S], fields: Mapping[str, Any]) -> S:
    """Build ``kind`` from ``fields`` (dicts or Structs) with every wire constraint checked.

    Raises:
        InvalidRequest: A field breaks its schema (``status`` is None: nothing was sent).
    """
    plain = msgspec.to_builtins({k: v for k, v in fields.items() if v is not msgspec.UNSET})
    try:
        return msgspec.convert(plain, kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(str(exc), code="invalid_request") from exc


def _session_path(session_id: str, tail: str = "") -> str:
    return f"/v1/sessions/{quote(session_id, safe='')}{tail}"


def _key(idempotency_key: str | None) -> str:
    return idempotency_key if idempotency_key is not None else uuid.uuid4().hex


def create_session(fields: Mapping[str, Any], idempotency_key: str | None) -> Call[SessionInfo]:
    body = _encoder.encode(_validated(CreateSessionRequest, fields))
    return Call("POST", "/v1/sessions", SessionInfo, body, idempotency_key=_key(idempotency_key))


def get_session(session_id: str) -> Call[SessionInfo]:
    return Call("GET", _session_path(session_id), SessionInfo)


def list_sessions(limit: int, after: str | None, parent_id: str | None) -> Call[SessionList]:
    params: dict[str, str | int] = {"limit": limit}
    params.update({k: v for k, v in (("after", after), ("parent_id", parent_id)) if v is not None})
    return Call("GET", "/v1/sessions", SessionList, params=params)


def next_cursor(page: SessionList) -> str | None:
    """The ``after`` of the page that follows ``page``, or None when it is the last."""
    return page.sessions[-1].id if page.has_more and page.sessions else None


def update_session(session_id: str, fields: Mapping[str, Any]) -> Call[SessionInfo]:
    body = _encoder.encode(_validated(UpdateSessionRequest, fields))
    return Call("PATCH", _session_path(session_id), SessionInfo, body, idempotency_key=_key(None))


def delete_session(session_id: str) -> Call[None]:
    return Call("DELETE", _session_path(session_id), None, idempotency_key=_key(None))


def append(session_id: str, request: AppendRequest,
           idempotency_key: str | None) -> Call[AppendResult]:
    body = _encoder.encode(request)
    return Call("POST", _session_path(session_id, "/append"), AppendResult, body,
                idempotency_key=_key(idempotency_key))


def append_request(fields: Mapping[str, Any], transport: str | None) -> AppendRequest:
    """Validate the SDK's append arguments into the wire request.

    Args:
        fields: The input and ``generate`` arguments.
        transport: None for a plain append, else the stream's transport.

    Raises:
        InvalidRequest: A field breaks its schema.
        ValueError: ``transport`` is neither ``"sse"`` nor ``"websocket"``.
    """
    if transport not in (None, "sse", "websocket"):
        raise ValueError(f"expected transport 'sse' or 'websocket', got {transport!r}")
    return _validated(AppendRequest, {**fields, "stream": transport == "sse"})


def fork(session_id: str, n: int, at_turn: int | None,
         idempotency_key: str | None) -> Call[ForkResult]:
    body = _encoder.encode(_validated(ForkRequest, {"n": n, "at_turn": at_turn}))
    return Call("POST", _session_path(session_id, "/fork"), ForkResult, body,
                idempotency_key=_key(idempotency_key))


def turns(session_id: str, include_tokens: bool) -> Call[TurnList]:
    params: dict[str, str | int] = {"include_tokens": "true"} if include_tokens else {}
    return Call("GET", _session_path(session_id, "/turns"), TurnList, params=params)


def offload(session_id: str, tier: str) -> Call[SessionInfo]:
    body = _encoder.encode(_validated(OffloadRequest, {"tier": tier}))
    return Call("POST", _session_path(session_id, "/offload"), SessionInfo, body,
                idempotency_key=_key(None))


def prefetch(session_id: str) -> Call[SessionInfo]:
    return Call("POST", _session_path(session_id, "/prefetch"), SessionInfo,
                idempotency_key=_key(None))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to retry a failed call, and after how long."""

    max_retries: int

    def delay(self, call: Call[Any], attempt: int, status: int | None,
              retry_after: str | None) -> float | None:
        """Seconds to wait before retry number ``attempt + 1``, or None if the failure is final.

        Args:
            call: The failed call.
            attempt: Retries already made (0 before the first).
            status: The response status, or None for a connection failure.
            retry_after: The response's ``Retry-After`` header, if any.

        Returns:
            The delay, or None when retries are spent, the call is unsafe to repeat, the status
            is not transient, or ``Retry-After`` exceeds ``MAX_RETRY_DELAY``.
        """
        if attempt >= self.max_retries or not call.retryable:
            return None
        if status is not None and status not in _RETRY_STATUSES:
            return None
        asked = parse_retry_after(retry_after)
        if asked is not None:
            return asked if asked <= MAX_RETRY_DELAY else None
        return min(0.5 * 2.0**attempt, 8.0) * random.uniform(0.75, 1.25)


class Retrying:
    """The attempts of one call: after each failure, how long to wait before the next, or what
    to raise. The clients' send loops only do the I/O (send, read the error body, sleep)."""

    def __init__(self, call: Call[Any], policy: RetryPolicy) -> None:
        self._call = call
        self._policy = policy
        self._attempt = 0

    def after_disconnect(self, exc: Exception) -> float:
        """Seconds to wait after the request failed to reach the server.

        Raises:
            APIConnectionError: The failure is final.
        """
        delay = self._next_delay(None, None)
        if delay is None:
            raise APIConnectionError(f"{self._call.method} {self._call.path}: {exc!r}") from exc
        return delay

    def after_error(self, status: int, body: bytes, retry_after: str | None) -> float:
        """Seconds to wait after an error response (``status`` >= 400).

        Raises:
            PhloemError: The failure is final (the exception of the body's code).
        """
        delay = self._next_delay(status, retry_after)
        if delay is None:
            raise error_from_response(status, body, retry_after)
        return delay

    def _next_delay(self, status: int | None, retry_after: str | None) -> float | None:
        delay = self._policy.delay(self._call, self._attempt, status, retry_after)
        self._attempt += 1
        return delay


def append_message(request: AppendRequest) -> str:
    """The WebSocket ``append`` message (a text frame) of an already validated request."""
    message = AppendMessage(input_ids=request.input_ids, messages=request.messages,
                            text=request.text, generate=request.generate,
                            chat_template_kwargs=request.chat_template_kwargs)
    return _encoder.encode(message).decode()


def cancel_message() -> str:
    """The WebSocket ``cancel`` message (a text frame)."""
    return _encoder.encode(CancelMessage()).decode()


def decode_ws_event(data: str | bytes) -> ServerEvent:
    """Decode one WebSocket frame of the server."""
    return _server_event_decoder.decode(data)


def ws_url(base_url: str, session_id: str) -> str:
    """The WebSocket URL of a session, from the HTTP(S) base URL of the server."""
    scheme, sep, rest = base_url.rstrip("/").partition("://")
    ws_scheme = {"http": "ws", "https": "wss"}.get(scheme.lower())
    if not sep or ws_scheme is None:
        raise ValueError(f"expected an http:// or https:// base_url, got {base_url!r}")
    return f"{ws_scheme}://{rest}{_session_path(session_id, '/ws')}"


def ws_connect_args(base_url: str, session_id: str, headers: Mapping[str, str],
                    timeout: float) -> tuple[str, dict[str, Any]]:
    """The URL and the ``connect`` options (sync and asyncio clients alike) of a session's
    WebSocket; the user agent is in ``headers``."""
    options = {"additional_headers": dict(headers), "user_agent_header": None,
               "open_timeout": min(timeout, 10.0), "max_size": 2**24}
    return ws_url(base_url, session_id), options


def ws_connect_error(url: str, exc: Exception) -> PhloemError:
    """The SDK exception for a failed WebSocket connect (one of ``WS_CONNECT_ERRORS``): the
    error of the server's answer when it refused the upgrade, else ``APIConnectionError``."""
    if isinstance(exc, websockets.exceptions.InvalidStatus):
        response = exc.response
        return error_from_response(response.status_code, bytes(response.body or b""),
                                   response.headers.get("Retry-After"))
    return APIConnectionError(f"WebSocket {url}: {exc!r}")


def settle(event: ServerEvent) -> DeltaEvent | AppendResult | None:
    """What a stream does with ``event``: yield a delta, finish with a result, or ignore it.

    Raises:
        PhloemError: The event is an ``error`` (as the exception of its code).
    """
    if isinstance(event, DeltaEvent):
        return event
    if isinstance(event, DoneEvent):
        return AppendResult(turn=event.turn, output_ids=event.output_ids, text=event.text,
                            finish_reason=event.finish_reason, usage=event.usage,
                            num_tokens=event.num_tokens, content=event.content,
                            reasoning_content=event.reasoning_content, tool_calls=event.tool_calls,
                            logprobs=event.logprobs)
    if isinstance(event, ErrorEvent):
        raise error_from_event(event)
    return None


class SSEDecoder:
    """Turns the lines of a ``text/event-stream`` body into stream events.

    Only ``data:`` lines matter (the event's ``type`` is inside the JSON, and equals the
    ``event:`` line); comments (``:`` keep-alives), ``event:``, ``id:`` and ``retry:`` lines and
    events without data are skipped.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._decoder = msgspec.json.Decoder(StreamEvent)

    def feed(self, line: str) -> Iterator[StreamEvent]:
        """Consume one line (without its line break); yield the event it completes, if any."""
        if line:
            name, _, value = line.partition(":")
            if name == "data":
                self._data.append(value.removeprefix(" "))
            return
        data, self._data = "\n".join(self._data), []
        # An event with empty data (Litestar sends ``data:`` after a comment) carries nothing.
        if data.strip():
            yield self._decoder.decode(data)


class StreamState:
    """A stream's state and event handling, shared by ``Stream`` and ``AsyncStream``.

    The streams only move bytes: they open the SSE response or the WebSocket, feed each decoded
    event to ``accept`` and yield the deltas it returns, and report how iteration ended to
    ``broken`` or ``ended``.

    Attributes:
        session_id: The session the stream appends to.
        request: The validated append request.
        transport: ``"sse"`` or ``"websocket"``.
        idempotency_key: The SSE request's key, if the caller gave one.
        closed: Whether the stream was closed (by the caller, or at its end).
        result: The committed turn, once the ``done`` event arrived.
    """

    def __init__(self, session_id: str, request: AppendRequest, transport: Transport,
                 idempotency_key: str | None) -> None:
        self.session_id = session_id
        self.request = request
        self.transport = transport
        self.idempotency_key = idempotency_key
        self.closed = False
        self.result: AppendResult | None = None

    def call(self) -> Call[AppendResult]:
        """The SSE request of the stream."""
        return append(self.session_id, self.request, self.idempotency_key)

    def accept(self, event: ServerEvent) -> DeltaEvent | None:
        """Take one event: the delta to yield, or None (then ``result`` is set if it was the
        ``done`` event, and iteration ends).

        Raises:
            PhloemError: The event is an ``error``.
        """
        item = settle(event)
        if isinstance(item, DeltaEvent):
            return item
        if item is not None:
            self.result = item
        return None

    def broken(self, exc: BaseException) -> APIConnectionError | None:
        """The error to raise when the connection broke (one of ``STREAM_BROKEN``), or None when
        the stream was closed on purpose."""
        return None if self.closed else APIConnectionError(f"the stream broke: {exc!r}")

    def ended(self) -> APIConnectionError | None:
        """The error to raise when the events ran out before ``done``, or None when the stream
        was closed on purpose."""
        return None if self.closed else APIConnectionError(
            "the stream ended before its `done` event")
