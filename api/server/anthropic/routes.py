"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Stateless, like chat completions: each request renders its whole conversation with the chat
template and runs one generation; the conversation's earlier turns are found in the prefix
cache (the caller's namespace), and ``usage.cache_read_input_tokens`` says how many prompt
tokens came from it. Nothing is stored, so there is nothing to continue but the messages: a
``tool_result`` simply extends the previous prompt. (The stateful, session-backed protocol is
the Responses API.) Tools, ``tool_choice`` (forced by the grammar), ``system``,
``stop_sequences`` and ``thinking`` are mapped as ``convert`` says; ``stream: true``
sends the events of ``stream``. Errors use Anthropic's envelope
(``{"type": "error", "error": {"type", "message"}}``, ``api.server.errors``); the key may come as
``x-api-key`` (``api.server.auth``). Generations count against the key's quota.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from phloem.api.schemas import ErrorCode
from phloem.api.server.anthropic import convert
from phloem.api.server.anthropic.schemas import CountTokensRequest, MessagesRequest
from phloem.api.server.anthropic.stream import MessageEvents
from phloem.api.server.context import ApiContext, named_sse as sse, owner_of, strict_body
from phloem.api.server.errors import (
    ApiError, StreamingOperation, anthropic_error_type, anthropic_errors, classify,
)
from phloem.sessions import (
    GenerateOptions, Generation, GenerationResult, ParsedDelta, ParsedOutput, SessionError,
)

__all__ = ["ANTHROPIC_ROUTES"]

_ERRORS = anthropic_errors(400, 401, 404, 413, 429, 503)


async def _prompt(ctx: ApiContext, owner: str, body: MessagesRequest | CountTokensRequest) -> list[int]:
    ctx.check_model(body.model)
    if body.messages[-1].role == "assistant":
        raise ApiError(ErrorCode.INVALID_REQUEST, "messages: the last message is the assistant's; "
                       "continuing (prefilling) a reply is not supported: end with a user message")
    return await ctx.manager.prompt_ids(owner, messages=convert.chat_messages(body.system, body.messages),
                                        tools=convert.chat_tools(body.tools),
                                        template_kwargs=convert.template_kwargs(body.thinking))


@post("/v1/messages", status_code=200, operation_class=StreamingOperation,
      responses={200: ResponseSpec(dict[str, Any], description="Anthropic's message object, or "
                                   "with `stream` its event stream"), **_ERRORS})
async def create_message(request: Request[Any, Any, Any], data: MessagesRequest,
                         ctx: ApiContext) -> Response[Any]:
    """Anthropic's Messages API (the chat template renders the whole conversation)."""
    body = await strict_body(request, MessagesRequest)
    owner = owner_of(request)
    prompt = await _prompt(ctx, owner, body)
    tools = convert.chat_tools(body.tools)
    choice, parallel = convert.tool_choice(body.tool_choice, tools is not None)
    options = GenerateOptions(
        max_tokens=body.max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
        stop=tuple(body.stop_sequences or ()), tool_choice=choice, parallel_tool_calls=parallel,
        tool_call_constraint=body.tool_call_constraint)

    async def start() -> Generation:
        [generation] = await ctx.manager.complete(prompt, options, tools=tools, owner=owner)
        return generation

    generation = await ctx.start_generation(owner, start)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": ctx.model_id}
    if body.stream:
        return Stream(_events(ctx, generation, head, len(prompt), body.stop_sequences or []),
                      media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    result = await generation.result()
    parsed = result.parsed or ParsedOutput(result.text or None, None)
    reason, sequence = convert.stop_reason(ctx.manager.tokenizer, result, parsed, body.stop_sequences or [])
    message = {**head, "content": convert.content_blocks(parsed), "stop_reason": reason,
               "stop_sequence": sequence, "usage": convert.usage(result)}
    return Response(_json(message), media_type="application/json")


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)


async def _events(ctx: ApiContext, generation: Generation, head: dict[str, Any], num_prompt: int,
                  stops: list[str]) -> AsyncIterator[bytes]:
    opening = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": num_prompt, "output_tokens": 0,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
    blocks = MessageEvents()
    try:
        yield sse({"type": "message_start", "message": opening})
        async for delta in ctx.paced(generation):
            if delta is None:
                yield sse({"type": "ping"})
                continue
            parsed = delta.parsed if delta.parsed is not None else ParsedDelta(content=delta.text)
            for event in blocks.delta(parsed):
                yield sse(event)
        try:
            result: GenerationResult = await generation.result()
        except SessionError as exc:
            code, detail, _ = classify(exc)
            yield sse({"type": "error", "error": {"type": anthropic_error_type(code), "message": detail}})
            return
        for event in blocks.close():
            yield sse(event)
        parsed = result.parsed or ParsedOutput(result.text or None, None)
        reason, sequence = convert.stop_reason(ctx.manager.tokenizer, result, parsed, stops)
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": convert.usage(result)})
        yield sse({"type": "message_stop"})
    finally:
        generation.cancel()


@post("/v1/messages/count_tokens", status_code=200,
      responses={200: ResponseSpec(dict[str, int], description="`input_tokens` of the prompt"), **_ERRORS})
async def count_tokens(request: Request[Any, Any, Any], data: CountTokensRequest,
                       ctx: ApiContext) -> Response[bytes]:
    """The prompt's token count, as ``POST /v1/messages`` would render it."""
    body = await strict_body(request, CountTokensRequest)
    prompt = await _prompt(ctx, owner_of(request), body)
    return Response(_json({"input_tokens": len(prompt)}), media_type="application/json")


ANTHROPIC_ROUTES = [create_message, count_tokens]
