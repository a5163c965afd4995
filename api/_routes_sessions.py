"""The native sessions routes (docs/api.md, "Routes"), REST and SSE.

Bodies are decoded strictly with the msgspec Structs of ``api.schemas`` (``strict_body``: a bad
field or a wrong type is a 400 naming it); every POST, PATCH and DELETE honours
``Idempotency-Key``. An SSE append
validates and starts its generation before the response starts, so 404/409/400/503 are plain
problem+json responses; once events flow, failures are ``error`` events. A client that closes
the stream cancels the generation, which commits what it generated so far.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, patch, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from phloem.api import _convert
from phloem.api._context import (
    KEEPALIVE_S, ApiContext, error_event, json_response, owner_of, replay, sse_message, strict_body,
)
from phloem.api._idempotency import Running, StoredResponse, StoredStream
from phloem.api.schemas import (
    AppendRequest, AppendResult, CreateSessionRequest, ForkRequest, ForkResult,
    OffloadRequest, SessionInfo, SessionList, TurnList, UpdateSessionRequest,
)
from phloem.sessions import KEEP, Generation, SessionError

__all__ = ["SESSION_ROUTES"]

_ID = "/v1/sessions/{session_id:str}"


def _doc(kind: type, description: str) -> dict[int, ResponseSpec]:
    return {200: ResponseSpec(data_container=kind, description=description)}


@post("/v1/sessions", status_code=201, responses={201: ResponseSpec(SessionInfo)})
async def create_session(request: Request[Any, Any, Any], data: CreateSessionRequest,
                         ctx: ApiContext) -> Response[bytes]:
    """Create a session; initial content (``input_ids``, ``messages`` or ``text``) is turn 0."""
    data = await strict_body(request, CreateSessionRequest)

    async def run() -> StoredResponse:
        content = _convert.session_input(data.input_ids, data.text, data.messages)
        snap = await ctx.manager.create(owner_of(request), metadata=data.metadata, ttl=data.ttl,
                                        content=content, tools=_convert.tool_specs(data.tools))
        return json_response(_convert.session_info(snap), 201,
                             {"Location": f"/v1/sessions/{snap.session_id}"})
    return await ctx.idempotent(request, run)


@get("/v1/sessions", responses=_doc(SessionList, "The caller's sessions, newest first"))
async def list_sessions(request: Request[Any, Any, Any], ctx: ApiContext,
                        limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
                        after: str | None = None, parent_id: str | None = None) -> Response[bytes]:
    """List sessions, newest first; ``after`` is the last id of the previous page."""
    page, has_more = ctx.manager.list_sessions(owner_of(request), limit=limit, after=after or None,
                                      parent_id=parent_id or None)
    body = SessionList(sessions=[_convert.session_info(s) for s in page], has_more=has_more)
    return Response(msgspec.json.encode(body), media_type="application/json")


@get(_ID, responses=_doc(SessionInfo, "The session"))
async def get_session(request: Request[Any, Any, Any], session_id: str,
                      ctx: ApiContext) -> Response[bytes]:
    """Look a session up."""
    info = _convert.session_info(ctx.manager.get(owner_of(request), session_id))
    return Response(msgspec.json.encode(info), media_type="application/json")


@patch(_ID, responses=_doc(SessionInfo, "The updated session"))
async def update_session(request: Request[Any, Any, Any], session_id: str,
                         data: UpdateSessionRequest, ctx: ApiContext) -> Response[bytes]:
    """Replace the metadata and/or the TTL (``"ttl": null``: the server default)."""
    data = await strict_body(request, UpdateSessionRequest)

    async def run() -> StoredResponse:
        metadata = KEEP if data.metadata is msgspec.UNSET else data.metadata
        ttl = KEEP if data.ttl is msgspec.UNSET else data.ttl
        snap = await ctx.manager.update(owner_of(request), session_id, metadata=metadata, ttl=ttl)
        return json_response(_convert.session_info(snap))
    return await ctx.idempotent(request, run)


@delete(_ID, status_code=204)
async def delete_session(request: Request[Any, Any, Any], session_id: str,
                         ctx: ApiContext) -> Response[None]:
    """Delete a session (a generation in flight is cancelled and commits nothing)."""
    async def run() -> StoredResponse:
        await ctx.manager.delete(owner_of(request), session_id)
        return json_response(None, 204)
    return await ctx.idempotent(request, run)  # type: ignore[return-value]


@post(f"{_ID}/fork", status_code=201, responses={201: ResponseSpec(ForkResult)})
async def fork_session(request: Request[Any, Any, Any], session_id: str, data: ForkRequest,
                       ctx: ApiContext) -> Response[bytes]:
    """Fork ``n`` children sharing the committed turns ``0..at_turn`` (default: all)."""
    data = await strict_body(request, ForkRequest)

    async def run() -> StoredResponse:
        children = await ctx.manager.fork(owner_of(request), session_id, data.n, data.at_turn)
        return json_response(ForkResult(sessions=[_convert.session_info(c) for c in children]), 201)
    return await ctx.idempotent(request, run)


@get(f"{_ID}/turns", responses=_doc(TurnList, "The committed turns, oldest first"))
async def list_turns(request: Request[Any, Any, Any], session_id: str, ctx: ApiContext,
                     include_tokens: bool = False) -> Response[bytes]:
    """Every committed turn (``include_tokens=true`` adds their token ids)."""
    turns = ctx.manager.turns(owner_of(request), session_id, include_tokens)
    body = TurnList(turns=[_convert.turn(t) for t in turns])
    return Response(msgspec.json.encode(body), media_type="application/json")


@post(f"{_ID}/offload", status_code=202, responses={202: ResponseSpec(SessionInfo)})
async def offload_session(request: Request[Any, Any, Any], session_id: str,
                          ctx: ApiContext) -> Response[bytes]:
    """Unpin the session's state (an ``OffloadRequest`` body, or none)."""
    has_body = bool((await request.body()).strip())
    body = await strict_body(request, OffloadRequest) if has_body else OffloadRequest()

    async def run() -> StoredResponse:
        snap = await ctx.manager.offload(owner_of(request), session_id, body.tier)
        return json_response(_convert.session_info(snap), 202)
    return await ctx.idempotent(request, run)


@post(f"{_ID}/prefetch", status_code=202, responses={202: ResponseSpec(SessionInfo)})
async def prefetch_session(request: Request[Any, Any, Any], session_id: str,
                           ctx: ApiContext) -> Response[bytes]:
    """Pin the session's state again, ahead of the next append."""
    async def run() -> StoredResponse:
        snap = await ctx.manager.prefetch(owner_of(request), session_id)
        return json_response(_convert.session_info(snap), 202)
    return await ctx.idempotent(request, run)


@post(f"{_ID}/append", status_code=200,
      responses=_doc(AppendResult, "The committed turn (or, with `stream`, an SSE stream)"))
async def append(request: Request[Any, Any, Any], session_id: str, data: AppendRequest,
                 ctx: ApiContext) -> Response[Any]:
    """Append input and optionally generate; the result is one new committed turn."""
    data = await strict_body(request, AppendRequest)
    owner, key = owner_of(request), request.headers.get("idempotency-key")
    claim = await ctx.claim(request, key) if key is not None else None
    if claim is not None and not isinstance(claim, Running):
        return replay(claim)
    try:
        generation = await ctx.manager.append(
            owner, session_id, _convert.session_input(data.input_ids, data.text, data.messages),
            _convert.generate_options(data.generate))
    except BaseException:
        if claim is not None and key is not None:
            ctx.idempotency.fail(owner, key, claim)
        raise
    if claim is not None and key is not None:
        # Stored by its own task: the turn commits even if this client goes away.
        ctx.spawn(_store_outcome(ctx, owner, key, claim, generation, data.stream))
    if data.stream:
        return ServerSentEvent(_sse_events(generation))
    result = _convert.append_result(await generation.result())
    return Response(msgspec.json.encode(result), media_type="application/json")


async def _store_outcome(ctx: ApiContext, owner: str, key: str, claim: Running,
                         generation: Generation, stream: bool) -> None:
    try:
        result = _convert.append_result(await generation.result())
    except SessionError:
        ctx.idempotency.fail(owner, key, claim)
        return
    outcome = StoredStream(result) if stream else json_response(result)
    ctx.idempotency.succeed(owner, key, claim, outcome)


async def _sse_events(generation: Generation) -> AsyncIterator[ServerSentEventMessage]:
    """The stream of one append: deltas (keep-alive comments while idle), then done or error."""
    deltas = generation.deltas()
    pending: asyncio.Future[Any] | None = None
    seq = 0
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(deltas, None))
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield ServerSentEventMessage(comment="keep-alive")
                continue
            delta, pending = pending.result(), None
            if delta is None:
                break
            yield sse_message(_convert.delta_event(delta, seq))
            seq += 1
        try:
            result = _convert.append_result(await generation.result())
        except SessionError as exc:
            yield sse_message(error_event(exc, seq))
            return
        yield sse_message(_convert.done_event(result, seq))
    finally:
        if pending is not None:
            pending.cancel()
        # The client went away mid-stream: stop, and commit what was generated.
        generation.cancel()


SESSION_ROUTES = [
    create_session, list_sessions, get_session, update_session, delete_session, fork_session,
    list_turns, offload_session, prefetch_session, append,
]
