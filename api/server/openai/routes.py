"""OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Stateless: each request renders (chat) or tokenizes (text prompt) its whole context and runs one
generation per choice (``n`` choices share one prefill of the prompt); repeated prefixes are
found by the engine's radix cache, which ``usage.prompt_tokens_details.cached_tokens`` reports.
Chat output is split into ``content``, ``reasoning_content`` and ``tool_calls``; ``tool_choice``
``required`` / a named function and ``response_format`` are enforced by a grammar
(docs/agents.md). Streams are ``data: <chunk>`` lines and a final ``data: [DONE]``
(``stream``); with ``stream_options.include_usage`` a last chunk with empty ``choices``
carries the usage (the others have ``"usage": null``). ``max_completion_tokens`` wins over
``max_tokens``. Errors use OpenAI's ``{"error": {...}}`` envelope (``api.server.errors``); a failure
after the stream started is sent as one ``data: {"error": ...}`` line before ``[DONE]``.
Generations count against the API key's quota like session appends (``n`` each); a stream sends
``: keep-alive`` comments while idle and is cancelled (finish ``stop``) after the idle timeout.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from phloem.api.schemas import ErrorCode
from phloem.api.server import convert
from phloem.api.server.context import ApiContext, owner_of, strict_body
from phloem.api.server.errors import ApiError, StreamingOperation, openai_errors
from phloem.api.server.openai.output import (
    TokenTexts, chat_delta, chat_logprobs, chat_message, completion_logprobs, finish_reason, usage,
)
from phloem.api.server.openai.schemas import ChatCompletionRequest, CompletionRequest, OpenAIMessage
from phloem.api.server.openai.stream import ChoiceShape, stream_lines
from phloem.sessions import (
    GenerateOptions, Generation, GenerationResult, Message, OutputDelta, SessionError, ToolSpec,
)

__all__ = ["OPENAI_ROUTES"]

logger = logging.getLogger(__name__)


def _options(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> GenerateOptions:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerateOptions(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k, seed=body.seed,
        stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, logit_bias=convert.logit_bias(body.logit_bias),
        min_tokens=body.min_tokens, logprobs=_num_logprobs(body))


def _num_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    return (body.top_logprobs or 0) if body.logprobs else None


def _chat_options(body: ChatCompletionRequest) -> GenerateOptions:
    options = _options(body, body.max_completion_tokens or body.max_tokens)
    return replace(options, response_format=convert.response_format(body.response_format),
                   tool_choice=convert.tool_choice(body.tool_choice or "auto"),
                   parallel_tool_calls=body.parallel_tool_calls is not False,
                   tool_call_constraint=body.tool_call_constraint)


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


# Bodies follow OpenAI's format (not restated here): documented as JSON objects.
_OK = {200: ResponseSpec(dict[str, Any], description="OpenAI's response object, or with "
                         "`stream` a `data:` event stream")}
_ERRORS = {**_OK, **openai_errors(400, 401, 404, 413, 429, 503)}


async def _start(ctx: ApiContext, request: Request[Any, Any, Any], prompt_ids: list[int],
                 options: GenerateOptions, n: int,
                 tools: tuple[ToolSpec, ...] | None = None) -> list[Generation]:
    """Start the ``n`` choices, each under the key's generation quota (all or none)."""
    owner = owner_of(request)
    started: list[Generation] = []

    async def start() -> Generation:
        started.extend(await ctx.manager.complete(prompt_ids, options, n=n, tools=tools, owner=owner))
        return started[0]

    extra = 0  # the other choices' quota; the first is start_generation's
    try:
        for _ in range(n - 1):
            ctx.limits.acquire_generation(owner)
            extra += 1
        await ctx.start_generation(owner, start)
    except BaseException:
        for _ in range(extra):
            ctx.limits.release_generation(owner)
        raise
    for generation in started[1:]:
        ctx.spawn(_release_when_settled(ctx, owner, generation))
    return started


async def _release_when_settled(ctx: ApiContext, owner: str, generation: Generation) -> None:
    try:
        with contextlib.suppress(SessionError):
            await generation.result()
    finally:
        ctx.limits.release_generation(owner)


async def _results(generations: list[Generation]) -> list[GenerationResult]:
    """Every choice's settled result; when one fails, the others are cancelled."""
    try:
        return [await g.result() for g in generations]
    except BaseException:
        for generation in generations:
            generation.cancel()
        raise


def _head(ctx: ApiContext, prefix: str, kind: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": ctx.model_id}


@post("/v1/chat/completions", status_code=200, operation_class=StreamingOperation,
      responses=_ERRORS)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionRequest,
                           ctx: ApiContext) -> Response[Any]:
    """OpenAI chat completions (the chat template renders the whole conversation)."""
    data = await strict_body(request, ChatCompletionRequest)
    ctx.check_model(data.model)
    tools = convert.tool_specs(data.tools)
    if data.prompt_cache_key is not None:
        logger.debug("chat completion with prompt_cache_key %r", data.prompt_cache_key[:64])
    prompt = await ctx.manager.prompt_ids(owner_of(request), messages=[_message(m) for m in data.messages],
                                          tools=tools, template_kwargs=_template_kwargs(data))
    generations = await _start(ctx, request, prompt, _chat_options(data), data.n, tools)
    texts = TokenTexts(ctx.manager.tokenizer)
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        head = _head(ctx, "chatcmpl", "chat.completion.chunk")
        return _stream(stream_lines(ctx, generations, head, include_usage, _chat_shape(texts),
                                    lambda i: _chat_choice(i, {"role": "assistant", "content": ""})))
    results = await _results(generations)
    choices = [{"index": i, "message": chat_message(r),
                "logprobs": chat_logprobs(r.logprobs, texts) if data.logprobs else None,
                "finish_reason": finish_reason(r)} for i, r in enumerate(results)]
    body = {**_head(ctx, "chatcmpl", "chat.completion"), "choices": choices, "usage": usage(results)}
    return Response(msgspec.json.encode(body), media_type="application/json")


def _template_kwargs(data: ChatCompletionRequest) -> dict[str, Any] | None:
    """``chat_template_kwargs``, with ``enable_thinking`` from ``reasoning_effort`` unless it
    sets it itself ("none" and "minimal": off; the rest: on). A template without the switch
    ignores the variable."""
    if data.reasoning_effort is None:
        return data.chat_template_kwargs
    thinking = data.reasoning_effort not in ("none", "minimal")
    return {"enable_thinking": thinking, **(data.chat_template_kwargs or {})}


def _chat_choice(index: int, delta: dict[str, Any], logprobs: Any = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}


def _chat_shape(texts: TokenTexts) -> ChoiceShape:
    """A delta is sent when its parse released reasoning, content or a tool call's part (a tool
    call being buffered, or text the detokenizer holds back, sends nothing yet)."""
    def shape(index: int, delta: OutputDelta | None, result: GenerationResult | None) -> dict[str, Any] | None:
        if delta is None:
            return _chat_choice(index, {})
        content = chat_delta(delta)
        logprobs = chat_logprobs(delta.logprobs, texts) if delta.logprobs else None
        return _chat_choice(index, content, logprobs) if content or logprobs else None
    return shape


@post("/v1/completions", status_code=200, operation_class=StreamingOperation, responses=_ERRORS)
async def completions(request: Request[Any, Any, Any], data: CompletionRequest,
                      ctx: ApiContext) -> Response[Any]:
    """OpenAI text completions; ``prompt`` is text or token ids."""
    data = await strict_body(request, CompletionRequest)
    ctx.check_model(data.model)
    prompt = await _prompt_ids(ctx, owner_of(request), data.prompt)
    generations = await _start(ctx, request, prompt, _options(data, data.max_tokens), data.n)
    texts = TokenTexts(ctx.manager.tokenizer)
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        head = _head(ctx, "cmpl", "text_completion")
        return _stream(stream_lines(ctx, generations, head, include_usage,
                                    _completion_shape(texts, data.return_token_ids), lambda i: None))
    results = await _results(generations)
    choices = []
    for i, r in enumerate(results):
        choice = {"index": i, "text": r.text, "finish_reason": finish_reason(r),
                  "logprobs": completion_logprobs(r.logprobs, texts) if data.logprobs is not None else None}
        if data.return_token_ids:
            choice["token_ids"] = list(r.output_ids)
        choices.append(choice)
    body = {**_head(ctx, "cmpl", "text_completion"), "choices": choices, "usage": usage(results)}
    return Response(msgspec.json.encode(body), media_type="application/json")


def _completion_shape(texts: TokenTexts, token_ids: bool) -> ChoiceShape:
    """Every delta that carries generated tokens is sent, its text empty while the detokenizer
    holds it back (a character split across tokens, the start of a possible stop string), as
    vLLM streams: a client's time to first token and per token (tokenspeed-trie's,
    the record's harness) are then the engine's, not the detokenizer's. With ``token_ids`` the
    choice carries the delta's ``token_ids``."""
    offsets: dict[int, int] = {}

    def shape(index: int, delta: OutputDelta | None, result: GenerationResult | None) -> dict[str, Any] | None:
        if delta is None:
            return {"index": index, "text": "", "logprobs": None, "finish_reason": None}
        if not delta.text and not delta.token_ids and not delta.logprobs:
            return None
        logprobs = None
        if delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, texts, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}
        if token_ids:
            choice["token_ids"] = list(delta.token_ids)
        return choice
    return shape


@get("/v1/models", responses={200: ResponseSpec(dict[str, Any], description="The served model"),
                               **openai_errors(401)})
async def list_models(ctx: ApiContext) -> Response[bytes]:
    """The served model, once per name it is served under (``--served-model-name``)."""
    return Response(msgspec.json.encode({"object": "list", "data": [_model(ctx, name) for name in ctx.model_names]}),
                    media_type="application/json")


@get("/v1/models/{model_id:path}", responses={200: ResponseSpec(dict[str, Any], description="The model"),
                                               **openai_errors(401, 404)})
async def retrieve_model(model_id: str, ctx: ApiContext) -> Response[bytes]:
    """The served model, by its id (any other id is 404)."""
    name = model_id.lstrip("/")
    ctx.check_model(name)
    return Response(msgspec.json.encode(_model(ctx, name)), media_type="application/json")


def _model(ctx: ApiContext, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": ctx.model_owned_by,
            "max_model_len": ctx.manager.max_model_len}


def _stream(chunks: AsyncIterator[bytes]) -> Stream:
    return Stream(chunks, media_type="text/event-stream",
                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


OPENAI_ROUTES = [chat_completions, completions, list_models, retrieve_model]
