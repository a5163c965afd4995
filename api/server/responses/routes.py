"""The OpenAI Responses API as a view of sessions (docs/api.md, "Responses").

- ``POST /v1/responses``: a response is a session turn (``start``: a new session, an
  append at the head, or a fork at an older turn; ``store: false`` leaves nothing behind), with
  function tools, ``instructions``, ``text.format`` (the grammar of ``sessions.text.structured``) and
  reasoning items; ``stream: true`` sends the events of ``stream``.
- ``GET /v1/responses/{id}``: the stored response, rebuilt from its turn
  (``output.turn_output``); ``DELETE`` forgets it (and its session, once no response of
  that session is left); ``GET /v1/responses/{id}/input_items`` lists the request's input items.

Response ids name their session and turn (``input``), so they are as durable as the
session (journal and index) and scoped like it: another key's response, a deleted one, or one
whose generation is still running is 404. Errors use OpenAI's envelope. Generations count
against the key's quota; a stream sends ``: keep-alive`` comments while idle.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Parameter
from litestar.response import Stream

from phloem.api.server.context import ApiContext, named_sse, owner_of, strict_body
from phloem.api.server.errors import StreamingOperation, classify, openai_errors
from phloem.api.server.responses.output import (
    output_items, reasoning_tokens, response_object, status_of, usage,
)
from phloem.api.server.responses.plan import echo, plan_response, plan_to_fit, stored_output
from phloem.api.server.responses.schemas import ResponseCreateRequest
from phloem.api.server.responses.start import Started, previous_turn, start_response
from phloem.api.server.responses.stream import ResponseEvents
from phloem.sessions import ContextLengthExceeded, GenerationResult, ParsedDelta, ParsedOutput, SessionError

__all__ = ["RESPONSES_ROUTES"]

logger = logging.getLogger(__name__)

_ERRORS = openai_errors(400, 401, 404, 413, 429, 503)
_ID = "/v1/responses/{response_id:str}"


@post("/v1/responses", status_code=200, operation_class=StreamingOperation,
      responses={200: ResponseSpec(dict[str, Any], description="The response object, or with "
                                   "`stream` its event stream"), **_ERRORS})
async def create_response(request: Request[Any, Any, Any], data: ResponseCreateRequest,
                          ctx: ApiContext) -> Response[Any]:
    """Create a response: a session turn (docs/api.md, "Responses")."""
    body = await strict_body(request, ResponseCreateRequest)
    ctx.check_model(body.model)
    owner = owner_of(request)
    created_at = int(time.time())
    if body.prompt_cache_key is not None:
        logger.debug("response with prompt_cache_key %r", body.prompt_cache_key[:64])
    plan, previous = plan_response(ctx, owner, body, created_at)
    try:
        started = await start_response(ctx, owner, plan, previous)
    except ContextLengthExceeded:
        if body.truncation != "auto":
            raise
        started = await start_response(ctx, owner, await plan_to_fit(ctx, owner, body, created_at), None)
    fields = echo(body, created_at)
    if body.stream:
        return Stream(_events(ctx, started, fields), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await started.generation.result()
    return _json(_finished(ctx, started.rid, fields, result))


def _finished(ctx: ApiContext, rid: str, echo: dict[str, Any], result: GenerationResult,
              output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    parsed = result.parsed or ParsedOutput(result.text or None, None)
    status = status_of(result.finish_reason)
    out = output if output is not None else output_items(rid, parsed, status)
    u = result.usage
    tokens = usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                   reasoning_tokens(ctx.manager.tokenizer, result.output_ids, parsed))
    return response_object(rid, ctx.model_id, echo, status, out, tokens)


async def _events(ctx: ApiContext, started: Started, echo: dict[str, Any]) -> AsyncIterator[bytes]:
    opening = response_object(started.rid, ctx.model_id, echo, "in_progress", [], None)
    events = ResponseEvents(started.rid, opening)
    generation = started.generation
    try:
        for event in events.start():
            yield named_sse(event)
        async for delta in ctx.paced(generation):
            if delta is None:
                yield b": keep-alive\n\n"
            else:
                parsed = delta.parsed if delta.parsed is not None else ParsedDelta(content=delta.text)
                for event in events.delta(parsed):
                    yield named_sse(event)
        try:
            result = await generation.result()
        except SessionError as exc:
            code, detail, _ = classify(exc)
            failed = {**opening, "status": "failed", "error": {"code": code.value, "message": detail}}
            yield named_sse(events.end("response.failed", failed))
            return
        status = status_of(result.finish_reason)
        for event in events.close("completed" if status == "completed" else "incomplete"):
            yield named_sse(event)
        final = _finished(ctx, started.rid, echo, result, events.items)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield named_sse(events.end(kind, final))
    finally:
        generation.cancel()


def _json(value: Any) -> Response[bytes]:
    return Response(msgspec.json.encode(value), media_type="application/json")


@get(_ID, responses={200: ResponseSpec(dict[str, Any], description="The response object"),
                     **openai_errors(401, 404)})
async def retrieve_response(request: Request[Any, Any, Any], response_id: str,
                            ctx: ApiContext) -> Response[bytes]:
    """A stored response, rebuilt from its session turn."""
    owner = owner_of(request)
    session_id, turn, record = previous_turn(ctx, owner, response_id)
    parsed, full, output_ids = stored_output(ctx, owner, session_id, turn, record)
    status = status_of(full.finish_reason)
    tokens = usage(full.end - full.num_output_tokens, full.num_cached_tokens, full.num_output_tokens,
                   reasoning_tokens(ctx.manager.tokenizer, output_ids, parsed))
    fields = {k: v for k, v in record.items() if k not in ("input", "context")}
    return _json(response_object(response_id, ctx.model_id, fields, status,
                                 output_items(response_id, parsed, status), tokens))


@delete(_ID, status_code=200, responses={200: ResponseSpec(dict[str, Any], description="Deleted"),
                                         **openai_errors(401, 404)})
async def delete_response(request: Request[Any, Any, Any], response_id: str,
                          ctx: ApiContext) -> Response[bytes]:
    """Forget a response; its session goes too once none of its own turns is a response (and
    no generation runs on it: that one will be)."""
    owner = owner_of(request)
    session_id, turn, _ = previous_turn(ctx, owner, response_id)
    await ctx.manager.set_turn_view(owner, session_id, turn.index, json.dumps({"deleted": True}))
    snapshot = ctx.manager.get(owner, session_id)
    inherited = 0 if snapshot.fork_turn is None else snapshot.fork_turn + 1
    own = ctx.manager.turns(owner, session_id)[inherited:]
    if not snapshot.generating and all(t.view is not None and json.loads(t.view).get("deleted") for t in own):
        await ctx.manager.delete(owner, session_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


@get(f"{_ID}/input_items", responses={200: ResponseSpec(dict[str, Any], description="The input items"),
                                      **openai_errors(401, 404)})
async def list_input_items(request: Request[Any, Any, Any], response_id: str, ctx: ApiContext,
                           limit: Annotated[int, Parameter(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc",
                           after: str | None = None) -> Response[bytes]:
    """The input items of a response's request (not the earlier conversation's), ``desc`` by
    default; ``after`` is an item id of the previous page."""
    _, _, record = previous_turn(ctx, owner_of(request), response_id)
    items = list(record.get("input") or [])
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return _json({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


RESPONSES_ROUTES = [create_response, retrieve_response, delete_response, list_input_items]
