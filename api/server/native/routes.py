"""The native sessions routes (docs/api.md, "Routes"), REST and SSE.

Bodies are decoded strictly with the msgspec Structs of ``api.schemas`` (``strict_body``: a bad
field or a wrong type is a 400 naming it). Every field of these bodies is optional, so an empty
body (or ``null``) is the empty object: ``POST /v1/sessions`` with no body creates an empty
session (the routes declare ``data`` optional, which the OpenAPI schema shows). Every POST,
PATCH and DELETE honours
``Idempotency-Key``. Every route is scoped to the caller's API key (``owner_of``): another key's
session, like a malformed id (``checked_session_id``), is 404 ``session_not_found``. Creates and
forks count against the key's session quota, generations against its generation quota (429).

An SSE append validates and starts its generation before the response starts, so
404/409/400/429/503 are plain problem+json responses; once events flow, failures are ``error``
events. A client that closes the stream cancels the generation, which commits what it generated
so far; so does a generation that produces nothing for the idle timeout (``pacing``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, patch, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from phloem.api.schemas import (
    AppendRequest, AppendResult, CreateSessionRequest, ErrorCode, ForkRequest, ForkResult,
    OffloadRequest, SessionInfo, SessionList, TurnList, UpdateSessionRequest,
)
from phloem.api.server.auth import principal_of
from phloem.api.server.context import (
    ApiContext, checked_session_id, error_event, json_response, owner_of, replay, sse_message,
    strict_body,
)
from phloem.api.server.errors import ApiError, StreamingOperation, problems
from phloem.api.server.idempotency import Running, StoredResponse, StoredStream
from phloem.api.server.convert import done_event, tool_specs
from phloem.api.server.native import convert
from phloem.runtime.logs import current_request_id
from phloem.sessions import KEEP, Generation, SessionError, SessionSnapshot

__all__ = ["SESSION_ROUTES"]

_ID = "/v1/sessions/{session_id:str}"
_ALL = {"true": True, "1": True, "false": False, "0": False}


def _doc(status: int, kind: type, description: str, *errors: int) -> dict[int, ResponseSpec]:
    return {status: ResponseSpec(data_container=kind, description=description), **problems(*errors)}


@post("/v1/sessions", status_code=201,
      responses=_doc(201, SessionInfo, "The new session", 400, 401, 413, 422, 429, 503))
async def create_session(request: Request[Any, Any, Any], ctx: ApiContext,
                         data: CreateSessionRequest | None = None) -> Response[bytes]:
    """Create a session; initial content (``input_ids``, ``messages`` or ``text``) is turn 0."""
    data = await strict_body(request, CreateSessionRequest)
    owner = owner_of(request)

    async def run() -> StoredResponse:
        content = convert.session_input(data.input_ids, data.text, data.messages)
        with ctx.limits.creating_sessions(owner, 1):
            snap = await ctx.manager.create(owner, metadata=data.metadata, ttl=data.ttl,
                                            content=content, tools=tool_specs(data.tools))
        return json_response(convert.session_info(snap), 201,
                             {"Location": f"/v1/sessions/{snap.session_id}"})
    return await ctx.idempotent(request, run)


@get("/v1/sessions",
     responses=_doc(200, SessionList, "The caller's sessions, newest first", 400, 401, 403))
async def list_sessions(request: Request[Any, Any, Any], ctx: ApiContext,
                        limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
                        after: str | None = None, parent_id: str | None = None,
                        all_keys: Annotated[str | None, Parameter(
                            query="all", description="`true`: every key's sessions (admin keys only)")] = None) -> Response[bytes]:
    """List sessions, newest first; ``after`` is the last id of the previous page; ``all=true``
    (admin keys only) lists every key's sessions."""
    every = _ALL.get((all_keys or "false").lower())
    if every is None:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"all: expected true or false, got {(all_keys or '')[:40]!r}")
    if every and not principal_of(request).admin:
        raise ApiError(ErrorCode.FORBIDDEN, "all=true: listing every key's sessions needs an "
                                            "admin API key")
    owners = ctx.keys.owners() if every else [owner_of(request)]
    page: list[SessionSnapshot] = []
    has_more = False
    for owner in owners:
        part, more = ctx.manager.list_sessions(owner, limit=limit, after=after or None,
                                               parent_id=parent_id or None)
        page += part
        has_more = has_more or more
    page.sort(key=lambda s: s.session_id, reverse=True)
    body = SessionList(sessions=[convert.session_info(s) for s in page[:limit]],
                       has_more=has_more or len(page) > limit)
    return Response(msgspec.json.encode(body), media_type="application/json")


@get(_ID, responses=_doc(200, SessionInfo, "The session", 401, 404))
async def get_session(request: Request[Any, Any, Any], session_id: str,
                      ctx: ApiContext) -> Response[bytes]:
    """Look a session up."""
    snap = ctx.manager.get(owner_of(request), checked_session_id(session_id))
    return Response(msgspec.json.encode(convert.session_info(snap)), media_type="application/json")


@patch(_ID, responses=_doc(200, SessionInfo, "The updated session", 400, 401, 404, 413, 422))
async def update_session(request: Request[Any, Any, Any], session_id: str,
                         ctx: ApiContext, data: UpdateSessionRequest | None = None) -> Response[bytes]:
    """Replace the metadata and/or the TTL (``"ttl": null``: the server default)."""
    session_id = checked_session_id(session_id)
    data = await strict_body(request, UpdateSessionRequest)

    async def run() -> StoredResponse:
        metadata = KEEP if data.metadata is msgspec.UNSET else data.metadata
        ttl = KEEP if data.ttl is msgspec.UNSET else data.ttl
        snap = await ctx.manager.update(owner_of(request), session_id, metadata=metadata, ttl=ttl)
        return json_response(convert.session_info(snap))
    return await ctx.idempotent(request, run)


@delete(_ID, status_code=204, responses={
    204: ResponseSpec(None, description="Deleted; no body"), **problems(400, 401, 404, 422)})
async def delete_session(request: Request[Any, Any, Any], session_id: str,
                         ctx: ApiContext) -> Response[None]:
    """Delete a session (a generation in flight is cancelled and commits nothing)."""
    session_id = checked_session_id(session_id)

    async def run() -> StoredResponse:
        await ctx.manager.delete(owner_of(request), session_id)
        return json_response(None, 204)
    return await ctx.idempotent(request, run)  # type: ignore[return-value]


@post(f"{_ID}/fork", status_code=201,
      responses=_doc(201, ForkResult, "The children", 400, 401, 404, 413, 422, 429, 503))
async def fork_session(request: Request[Any, Any, Any], session_id: str, ctx: ApiContext,
                       data: ForkRequest | None = None) -> Response[bytes]:
    """Fork ``n`` children sharing the committed turns ``0..at_turn`` (default: all)."""
    session_id = checked_session_id(session_id)
    data = await strict_body(request, ForkRequest)
    owner = owner_of(request)

    async def run() -> StoredResponse:
        ctx.manager.get(owner, session_id)  # a foreign or unknown parent is 404 before any quota
        with ctx.limits.creating_sessions(owner, data.n):
            children = await ctx.manager.fork(owner, session_id, data.n, data.at_turn)
        return json_response(ForkResult(sessions=[convert.session_info(c) for c in children]), 201)
    return await ctx.idempotent(request, run)


@get(f"{_ID}/turns", responses=_doc(200, TurnList, "The committed turns, oldest first", 400, 401, 404))
async def list_turns(request: Request[Any, Any, Any], session_id: str, ctx: ApiContext,
                     include_tokens: bool = False) -> Response[bytes]:
    """Every committed turn (``include_tokens=true`` adds their token ids)."""
    turns = ctx.manager.turns(owner_of(request), checked_session_id(session_id), include_tokens)
    body = TurnList(turns=[convert.turn(t) for t in turns])
    return Response(msgspec.json.encode(body), media_type="application/json")


@post(f"{_ID}/offload", status_code=202,
      responses=_doc(202, SessionInfo, "Accepted; the move runs in the background",
                     400, 401, 404, 409, 413, 422))
async def offload_session(request: Request[Any, Any, Any], session_id: str,
                          ctx: ApiContext) -> Response[bytes]:
    """Spill the session's state to host memory or disk and unpin it, in the background (an
    ``OffloadRequest`` body, or none); 202 with the status as of acceptance."""
    session_id = checked_session_id(session_id)
    has_body = bool((await request.body()).strip())
    body = await strict_body(request, OffloadRequest) if has_body else OffloadRequest()

    async def run() -> StoredResponse:
        snap = await ctx.manager.offload(owner_of(request), session_id, body.tier)
        return json_response(convert.session_info(snap), 202)
    return await ctx.idempotent(request, run)


@post(f"{_ID}/prefetch", status_code=202,
      responses=_doc(202, SessionInfo, "Accepted; the load runs in the background",
                     400, 401, 404, 422))
async def prefetch_session(request: Request[Any, Any, Any], session_id: str,
                           ctx: ApiContext) -> Response[bytes]:
    """Load the session's spilled state back and pin it, in the background, ahead of the next
    append; 202 with the status as of acceptance."""
    session_id = checked_session_id(session_id)

    async def run() -> StoredResponse:
        snap = await ctx.manager.prefetch(owner_of(request), session_id)
        return json_response(convert.session_info(snap), 202)
    return await ctx.idempotent(request, run)


@post(f"{_ID}/append", status_code=200, operation_class=StreamingOperation,
      responses=_doc(200, AppendResult, "The committed turn (or, with `stream`, an SSE stream)",
                     400, 401, 404, 409, 413, 422, 429, 503))
async def append(request: Request[Any, Any, Any], session_id: str, ctx: ApiContext,
                 data: AppendRequest | None = None) -> Response[Any]:
    """Append input and optionally generate; the result is one new committed turn."""
    session_id = checked_session_id(session_id)
    data = await strict_body(request, AppendRequest)
    owner, key = owner_of(request), request.headers.get("idempotency-key")
    claim = await ctx.claim(request, key) if key is not None else None
    if claim is not None and not isinstance(claim, Running):
        return replay(claim)
    try:
        generation = await _start_append(ctx, owner, session_id, data)
    except BaseException:
        if claim is not None and key is not None:
            ctx.idempotency.fail(owner, key, claim)
        raise
    if claim is not None and key is not None:
        # Stored by its own task: the turn commits even if this client goes away.
        ctx.spawn(_store_outcome(ctx, owner, key, claim, generation, data.stream))
    if data.stream:
        return ServerSentEvent(_sse_events(ctx, generation))
    result = convert.append_result(await generation.result())
    return Response(msgspec.json.encode(result), media_type="application/json")


async def _start_append(ctx: ApiContext, owner: str, session_id: str,
                        data: AppendRequest) -> Generation:
    async def start() -> Generation:
        return await ctx.manager.append(
            owner, session_id,
            convert.session_input(data.input_ids, data.text, data.messages, data.chat_template_kwargs),
            convert.generate_options(data.generate))
    if data.generate is None:
        return await start()
    ctx.manager.get(owner, session_id)  # a foreign or unknown session is 404, not 429
    return await ctx.start_generation(owner, start)


async def _store_outcome(ctx: ApiContext, owner: str, key: str, claim: Running,
                         generation: Generation, stream: bool) -> None:
    try:
        result = convert.append_result(await generation.result())
    except SessionError:
        ctx.idempotency.fail(owner, key, claim)
        return
    outcome = StoredStream(result) if stream else json_response(result)
    ctx.idempotency.succeed(owner, key, claim, outcome)


async def _sse_events(ctx: ApiContext,
                      generation: Generation) -> AsyncIterator[ServerSentEventMessage]:
    """The stream of one append: deltas (keep-alive comments while idle), then done or error."""
    seq = 0
    try:
        async for delta in ctx.paced(generation):
            if delta is None:
                yield ServerSentEventMessage(comment="keep-alive")
                continue
            if not delta.text and not delta.token_ids:
                continue  # it only closes the parsed parts, which the done event carries
            yield sse_message(convert.delta_event(delta, seq))
            seq += 1
        try:
            result = convert.append_result(await generation.result())
        except SessionError as exc:
            yield sse_message(error_event(exc, seq, current_request_id()))
            return
        yield sse_message(done_event(result, seq))
    finally:
        # The client went away mid-stream: stop, and commit what was generated.
        generation.cancel()


SESSION_ROUTES = [
    create_session, list_sessions, get_session, update_session, delete_session, fork_session,
    list_turns, offload_session, prefetch_session, append,
]
