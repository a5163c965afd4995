"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Stateless: each request renders (chat) or tokenizes (text prompt) its whole context and runs one
generation; repeated prefixes are found by the engine's radix cache, which
``usage.prompt_tokens_details.cached_tokens`` reports. Streams are ``data: <chunk>`` lines and a
final ``data: [DONE]``; with ``stream_options.include_usage`` a last chunk with empty ``choices``
carries the usage (the others have ``"usage": null``). ``max_completion_tokens`` wins over
``max_tokens``. Errors use OpenAI's ``{"error": {...}}`` envelope (``_errors_http``); a failure
after the stream started is sent as one ``data: {"error": ...}`` line before ``[DONE]``.
Generations count against the API key's quota like session appends; a stream sends
``: keep-alive`` comments while idle and is cancelled (finish ``stop``) after the idle timeout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from phloem.api import _convert
from phloem.api._context import ApiContext, owner_of, strict_body
from phloem.api._errors_http import ApiError, StreamingOperation, classify, openai_errors
from phloem.api._openai_schemas import ChatCompletionRequest, CompletionRequest, OpenAIMessage
from phloem.api.schemas import ErrorCode
from phloem.sessions import GenerateOptions, Generation, GenerationResult, Message, SessionError

__all__ = ["OPENAI_ROUTES"]

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


def _options(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> GenerateOptions:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerateOptions(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k, seed=body.seed,
        stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)


def _check_model(ctx: ApiContext, model: str) -> None:
    if model != ctx.model_id:
        raise ApiError(ErrorCode.NOT_FOUND,
                       f"model: this server serves {ctx.model_id!r}, got {model!r}")


def _message(m: OpenAIMessage) -> Message:
    content: str | None
    if isinstance(m.content, list):
        content = "".join(part.text for part in m.content)
    else:
        content = m.content
    role = "system" if m.role == "developer" else m.role
    out = {"role": role, "content": content, "name": m.name, "tool_call_id": m.tool_call_id,
           "tool_calls": [msgspec.to_builtins(c) for c in m.tool_calls] if m.tool_calls else None}
    return {k: v for k, v in out.items() if v is not None}


async def _prompt_ids(ctx: ApiContext, owner: str, prompt: str | list[Any]) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return await ctx.manager.prompt_ids(owner, text=prompt)
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(ErrorCode.INVALID_REQUEST,
                   "prompt: expected a string or a non-empty list of token ids (batches of more "
                   f"than one prompt are not supported), got {str(prompt)[:80]}")


def _usage(r: GenerationResult) -> dict[str, Any]:
    u = r.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


# Bodies follow OpenAI's format (not restated here): documented as JSON objects.
_OK = {200: ResponseSpec(dict[str, Any], description="OpenAI's response object, or with "
                         "`stream` a `data:` event stream")}
_ERRORS = {**_OK, **openai_errors(400, 401, 404, 413, 429, 503)}


async def _start(ctx: ApiContext, request: Request[Any, Any, Any], prompt_ids: list[int],
                 options: GenerateOptions) -> Generation:
    owner = owner_of(request)

    async def start() -> Generation:
        return ctx.manager.complete(prompt_ids, options, owner)
    return await ctx.start_generation(owner, start)


@post("/v1/chat/completions", status_code=200, operation_class=StreamingOperation,
      responses=_ERRORS)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionRequest,
                           ctx: ApiContext) -> Response[Any]:
    """OpenAI chat completions (the chat template renders the whole conversation)."""
    data = await strict_body(request, ChatCompletionRequest)
    _check_model(ctx, data.model)
    prompt = await ctx.manager.prompt_ids(owner_of(request), messages=[_message(m) for m in data.messages],
                                          tools=_convert.tool_specs(data.tools))
    max_tokens = data.max_completion_tokens or data.max_tokens
    generation = await _start(ctx, request, prompt, _options(data, max_tokens))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.model_id}
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        return _stream(_chat_chunks(ctx, generation, head, include_usage))
    result = await generation.result()
    body = {**head, "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": result.text},
        "logprobs": None, "finish_reason": _FINISH[result.finish_reason or "stop"]}],
        "usage": _usage(result)}
    return Response(msgspec.json.encode(body), media_type="application/json")


@post("/v1/completions", status_code=200, operation_class=StreamingOperation, responses=_ERRORS)
async def completions(request: Request[Any, Any, Any], data: CompletionRequest,
                      ctx: ApiContext) -> Response[Any]:
    """OpenAI text completions; ``prompt`` is text or token ids."""
    data = await strict_body(request, CompletionRequest)
    _check_model(ctx, data.model)
    generation = await _start(ctx, request, await _prompt_ids(ctx, owner_of(request), data.prompt),
                              _options(data, data.max_tokens))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.model_id}
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        return _stream(_completion_chunks(ctx, generation, head, include_usage,
                                          data.return_token_ids))
    result = await generation.result()
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": _FINISH[result.finish_reason or "stop"]}
    if data.return_token_ids:
        choice["token_ids"] = list(result.output_ids)
    body = {**head, "object": "text_completion", "choices": [choice], "usage": _usage(result)}
    return Response(msgspec.json.encode(body), media_type="application/json")


@get("/v1/models", responses={200: ResponseSpec(dict[str, Any], description="The served model"),
                               **openai_errors(401)})
async def list_models(ctx: ApiContext) -> Response[bytes]:
    """The one served model."""
    entry = {"id": ctx.model_id, "object": "model", "created": 0, "owned_by": ctx.model_owned_by,
             "max_model_len": ctx.manager.max_model_len}
    return Response(msgspec.json.encode({"object": "list", "data": [entry]}),
                    media_type="application/json")


def _stream(chunks: AsyncIterator[bytes]) -> Stream:
    return Stream(chunks, media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _line(value: Any) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


async def _chunks(ctx: ApiContext, generation: Generation, head: dict[str, Any],
                  include_usage: bool, kind: str, choice: Any,
                  token_ids: bool = False) -> AsyncIterator[bytes]:
    """The stream's ``data:`` lines; ``choice(text, finish_reason, first)`` shapes a choice.

    With ``token_ids``, every delta is sent (text may be held back by the detokenizer) and its
    choice carries the delta's ``token_ids``.
    """
    extra = {"usage": None} if include_usage else {}
    chunk = {**head, "object": kind, **extra}
    try:
        first = choice(None, None, True)
        if first is not None:
            yield _line({**chunk, "choices": [first]})
        async for delta in ctx.paced(generation):
            if delta is None:
                yield b": keep-alive\n\n"
            elif token_ids:
                yield _line({**chunk, "choices": [{**choice(delta.text, None, False), "token_ids": list(delta.token_ids)}]})
            elif delta.text:
                yield _line({**chunk, "choices": [choice(delta.text, None, False)]})
        try:
            result = await generation.result()
        except SessionError as exc:
            code, detail, _ = classify(exc)
            yield _line({"error": {"message": detail, "type": "server_error", "code": code.value}})
        else:
            reason = _FINISH[result.finish_reason or "stop"]
            yield _line({**chunk, "choices": [choice(None, reason, False)]})
            if include_usage:
                yield _line({**chunk, "choices": [], "usage": _usage(result)})
        yield b"data: [DONE]\n\n"
    finally:
        generation.cancel()


def _chat_chunks(ctx: ApiContext, generation: Generation, head: dict[str, Any],
                 include_usage: bool) -> AsyncIterator[bytes]:
    def choice(text: str | None, reason: str | None, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    return _chunks(ctx, generation, head, include_usage, "chat.completion.chunk", choice)


def _completion_chunks(ctx: ApiContext, generation: Generation, head: dict[str, Any],
                       include_usage: bool, token_ids: bool = False) -> AsyncIterator[bytes]:
    def choice(text: str | None, reason: str | None, first: bool) -> dict[str, Any] | None:
        if first:
            return None
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return _chunks(ctx, generation, head, include_usage, "text_completion", choice, token_ids)


OPENAI_ROUTES = [chat_completions, completions, list_models]
