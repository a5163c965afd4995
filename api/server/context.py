"""What every route shares: the manager, the idempotency store, the caller of a request and its
quotas, the session-id check, and the JSON/SSE response helpers (including idempotent execution
and replay)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from phloem.api.schemas import (
    AppendResult, DeltaEvent, ErrorCode, ErrorEvent, StreamEvent,
)
from phloem.api.server.auth import KeyRing, principal_of
from phloem.api.server.convert import done_event
from phloem.api.server.errors import ApiError, classify, malformed_json
from phloem.api.server.idempotency import (
    IdempotencyStore, Running, StoredResponse, StoredStream, fingerprint,
)
from phloem.api.server.limits import OwnerLimits
from phloem.api.server.pacing import paced_deltas
from phloem.sessions import Generation, OutputDelta, SessionError, SessionManager

__all__ = [
    "KEEPALIVE_S", "ApiContext", "checked_session_id", "error_event", "json_response", "named_sse",
    "owner_of", "replay", "sse_message", "strict_body",
]

T = TypeVar("T")

KEEPALIVE_S = 15.0
# The ids the sessions layer makes and storage accepts (storage._fs.check_id): anything else
# cannot exist, and is refused before it reaches the manager (or a log line, or a path).
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(eq=False)
class ApiContext:
    """The app's shared state, handed to routes as the ``ctx`` dependency.

    Args:
        manager: The session manager.
        model_id: The served model's name (``/v1/models``, OpenAI responses).
        model_owned_by: ``owned_by`` of the model in ``/v1/models``.
        keys: The accepted API keys (``AuthMiddleware`` checks them; the admin listing needs
            every owner).
        limits: Per-key quotas.
        stream_idle_timeout_s: A stream whose generation produces nothing this long is
            cancelled; an idle WebSocket is closed.
        idempotency: Outcomes by ``Idempotency-Key``.
        model_aliases: Other names of the served model, accepted in a request's ``model`` and
            listed in ``/v1/models`` after ``model_id`` (``--served-model-name`` given twice).
    """

    manager: SessionManager
    model_id: str
    model_owned_by: str
    keys: KeyRing
    limits: OwnerLimits
    stream_idle_timeout_s: float
    idempotency: IdempotencyStore = field(default_factory=IdempotencyStore)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    model_aliases: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the served model answers to, ``model_id`` first."""
        return (self.model_id, *self.model_aliases)

    def check_model(self, model: str) -> None:
        """Raise ``ApiError`` ``not_found`` unless ``model`` names the served model."""
        if model not in self.model_names:
            raise ApiError(ErrorCode.NOT_FOUND, f"model: this server serves {self.model_id!r}, got {model!r}")

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run ``coro`` on its own task, kept alive until it ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def start_generation(self, owner: str,
                               start: Callable[[], Awaitable[Generation]]) -> Generation:
        """Start a generation under ``owner``'s quota; the count drops when it settles.

        Raises:
            ApiError: ``rate_limited`` (the key runs its most generations).
            SessionError: Whatever ``start`` raises (the count is released).
        """
        self.limits.acquire_generation(owner)
        try:
            generation = await start()
        except BaseException:
            self.limits.release_generation(owner)
            raise

        async def release_when_settled() -> None:
            try:
                # A failure is its consumer's to report; here only the count matters.
                with contextlib.suppress(SessionError):
                    await generation.result()
            finally:
                self.limits.release_generation(owner)
        self.spawn(release_when_settled())
        return generation

    def paced(self, generation: Generation) -> AsyncIterator[OutputDelta | None]:
        """The generation's deltas with keep-alives and the idle timeout (``pacing``)."""
        return paced_deltas(generation, self.stream_idle_timeout_s, KEEPALIVE_S)

    async def idempotent(self, request: Request[Any, Any, Any],
                         run: Callable[[], Awaitable[StoredResponse]]) -> Response[bytes]:
        """Run ``run`` once per ``Idempotency-Key`` (if the request has one) and answer its
        response, or replay the stored one. The run finishes even if the client goes away."""
        key = request.headers.get("idempotency-key")
        if key is None:
            return _respond(await run(), replayed=False)
        claim = await self.claim(request, key)
        if not isinstance(claim, Running):
            return replay(claim)
        owner = owner_of(request)

        async def run_and_store() -> StoredResponse:
            try:
                outcome = await run()
            except BaseException:
                self.idempotency.fail(owner, key, claim)
                raise
            self.idempotency.succeed(owner, key, claim, outcome)
            return outcome

        return _respond(await asyncio.shield(self.spawn(run_and_store())), replayed=False)

    async def claim(self, request: Request[Any, Any, Any],
                    key: str) -> Running | StoredResponse | StoredStream:
        """Claim ``key`` for this request (see ``IdempotencyStore.claim``)."""
        self.idempotency.check_key(key)
        body = await request.body()
        return await self.idempotency.claim(
            owner_of(request), key, fingerprint(request.method, request.url.path, body))


async def strict_body(request: Request[Any, Any, Any], kind: type[T]) -> T:
    """Decode the raw body strictly into ``kind``; an empty body (or ``null``) is ``{}``.

    NOTE: Litestar converts ``data`` with ``strict=False`` (``"3"`` would pass as an int), so
    routes declare ``data`` for validation of the shape and the OpenAPI schema, then decode the
    same (cached) bytes again here, as the wire contract says: a wrong type is a 400.

    Raises:
        ApiError: ``invalid_request`` with msgspec's message (it names the field), or
            ``malformed_json``'s for a body that is not JSON.
    """
    body = await request.body()
    try:
        return msgspec.json.decode(body if body.strip() not in (b"", b"null") else b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, malformed_json(str(exc))) from exc
    except UnicodeDecodeError as exc:  # msgspec < 0.23's word for "not UTF-8"
        raise ApiError(ErrorCode.INVALID_REQUEST, malformed_json("Invalid UTF-8 encoded string")) from exc


def owner_of(connection: Any) -> str:
    """The owner of a request or socket: its API key's owner id (without keys: ``anonymous``)."""
    return principal_of(connection).owner


def checked_session_id(session_id: str) -> str:
    """``session_id``, if it has the form of a session id.

    Raises:
        ApiError: ``session_not_found`` (no such id can exist; the detail quotes at most 64
            characters of it).
    """
    if _SESSION_ID.fullmatch(session_id) is None:
        raise ApiError(ErrorCode.SESSION_NOT_FOUND,
                       f"no session {session_id[:64]!r}: session ids are 1-128 characters of "
                       f"[A-Za-z0-9_-], got {len(session_id)} characters")
    return session_id


def json_response(value: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> StoredResponse:
    """A JSON response, in the form the idempotency store keeps."""
    body = b"" if value is None else msgspec.json.encode(value)
    return StoredResponse(status, body, "application/json", tuple((headers or {}).items()))


def _respond(stored: StoredResponse, replayed: bool) -> Response[bytes]:
    headers = dict(stored.headers)
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(stored.body, status_code=stored.status, media_type=stored.media_type,
                    headers=headers)


def sse_message(event: StreamEvent) -> ServerSentEventMessage:
    """One SSE event: ``event:`` names its type, ``data:`` is its JSON."""
    name = str(type(event).__struct_config__.tag)
    return ServerSentEventMessage(data=msgspec.json.encode(event).decode(), event=name)


def named_sse(event: dict[str, Any]) -> bytes:
    """One SSE message of a typed event (OpenAI Responses, Anthropic): ``event:`` is its
    ``type``, ``data:`` its JSON."""
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def replay(outcome: StoredResponse | StoredStream) -> Response[Any]:
    """Replay a stored outcome (``Idempotent-Replayed: true``); a stream as one delta + done."""
    if isinstance(outcome, StoredResponse):
        return _respond(outcome, replayed=True)
    return ServerSentEvent(_replayed_events(outcome.result),
                           headers={"Idempotent-Replayed": "true"})


async def _replayed_events(result: AppendResult) -> AsyncIterator[ServerSentEventMessage]:
    seq = 0
    if result.output_ids or result.text:
        yield sse_message(DeltaEvent(sequence_number=0, text=result.text,
                                     token_ids=result.output_ids))
        seq = 1
    yield sse_message(done_event(result, seq))


def error_event(exc: BaseException, sequence_number: int,
                request_id: str | None = None) -> ErrorEvent:
    """The in-stream ``error`` event for ``exc``."""
    code, detail, retry_after = classify(exc)
    return ErrorEvent(sequence_number=sequence_number, code=code.value, message=detail,
                      retry_after=retry_after, request_id=request_id)
