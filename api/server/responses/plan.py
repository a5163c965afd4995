"""A Responses request as a ``Plan``: what to render, where to continue, and what to store.

The conversation's ``instructions`` (its system message) and ``tools`` are rendered in its first
turn. A continuation (``previous_response_id``) that leaves them out, or sends the ones in
effect, continues the session (``start``): only its new items are rendered. One that
sends other instructions or tools cannot reuse those tokens, so the conversation is rendered
again from its stored items (each earlier response's input items and output, following the
``previous_response_id`` chain) under the new ones, as a new session; the prefix cache still
finds what it can. (Instructions left out keep the conversation's, unlike OpenAI, where they
would be dropped: the cached turns keep them either way. Tools left out keep them rendered, but
no call is parsed.)

Each stored turn's ``view`` is this module's JSON: the response fields it echoes (``_echo``),
the request's ``input`` items, and the ``context`` in effect after it (the conversation's
instructions and tools), which the next continuation compares against.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from phloem.api.schemas import ErrorCode
from phloem.api.server.context import ApiContext
from phloem.api.server.errors import ApiError
from phloem.api.server.responses.input import (
    chat_messages, chat_tools, response_format, stored_items, tool_choice,
)
from phloem.api.server.responses.output import turn_output
from phloem.api.server.responses.schemas import (
    FormatText, FunctionCallItem, FunctionTool, InputItem, MessageItem, ReasoningItem, ReasoningText,
    ResponseCreateRequest, decode_items,
)
from phloem.api.server.responses.start import Plan, previous_turn
from phloem.sessions import (
    ContextLengthExceeded, GenerateOptions, InvalidInput, Message, ParsedOutput, SessionError, ToolChoice,
    TurnInfo,
)

__all__ = ["echo", "plan_response", "plan_to_fit", "stored_output"]

# A chain longer than this is refused rather than walked (each step is a stored response).
_MAX_CHAIN = 10_000


def echo(body: ResponseCreateRequest, created_at: int) -> dict[str, Any]:
    """The request fields a response repeats."""
    reasoning = body.reasoning
    choice = body.tool_choice or "auto"
    return {
        "created_at": created_at, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": msgspec.to_builtins((body.text.format if body.text else None) or FormatText())},
        "tool_choice": choice if isinstance(choice, str) else msgspec.to_builtins(choice),
        "tools": [msgspec.to_builtins(t) for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
        "user": body.user,
    }


def _items(body: ResponseCreateRequest) -> list[InputItem]:
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=body.input)]
    try:
        return decode_items(body.input)
    except ValueError as exc:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(exc)) from exc


def _tools(raw: list[Any]) -> list[FunctionTool]:
    return [msgspec.convert(t, FunctionTool) for t in raw]


def plan_response(ctx: ApiContext, owner: str, body: ResponseCreateRequest,
                  created_at: int) -> tuple[Plan, tuple[str, int] | None]:
    """The plan of a request, and the (session, turn) it continues (None: a new session).

    Raises:
        ApiError: ``not_found`` for an unknown ``previous_response_id`` (or one in its chain),
            ``invalid_request`` for input that cannot be rendered.
    """
    items = _items(body)
    previous: tuple[str, int] | None = None
    instructions, tools = body.instructions, body.tools
    history: list[InputItem] = []
    if body.previous_response_id is not None:
        session_id, turn, context, instructions, tools = _inherit(ctx, owner, body)
        if instructions == context["instructions"] and chat_tools(tools) == chat_tools(_tools(context["tools"])):
            previous = (session_id, turn.index)
        else:
            history = _conversation(ctx, owner, body.previous_response_id)
    messages = chat_messages(history + items)
    if not chat_messages(items):
        raise ApiError(ErrorCode.INVALID_REQUEST, "input: expected at least one message, "
                       "function_call or function_call_output item")
    if previous is None and instructions is not None:
        messages.insert(0, {"role": "system", "content": instructions})
    return _plan(body, created_at, items, messages, instructions, tools), previous


def _inherit(
    ctx: ApiContext, owner: str, body: ResponseCreateRequest,
) -> tuple[str, TurnInfo, dict[str, Any], str | None, list[FunctionTool] | None]:
    """The turn ``body.previous_response_id`` names, its stored context, and the instructions and
    tools the request runs under: its own, else those of that turn (the Responses API's rule).

    Raises:
        ApiError: ``not_found`` for an unknown ``previous_response_id``.
    """
    assert body.previous_response_id is not None
    session_id, turn, record = previous_turn(ctx, owner, body.previous_response_id)
    context = record["context"]
    instructions = context["instructions"] if body.instructions is None else body.instructions
    tools = _tools(context["tools"]) if body.tools is None else body.tools
    return session_id, turn, context, instructions, tools

async def plan_to_fit(ctx: ApiContext, owner: str, body: ResponseCreateRequest, created_at: int) -> Plan:
    """``truncation: "auto"`` once the plan of ``plan_response`` did not fit the context window:
    the whole conversation (the ``previous_response_id`` chain's items, then the request's)
    rendered as a new session under its instructions, without its oldest items, dropped one
    by one until the prompt leaves room for a generated token. The instructions (the system
    message) and the tools are always kept; so is the request's last item.

    Raises:
        ApiError: ``not_found`` for an unknown ``previous_response_id`` (or one in its chain).
        ContextLengthExceeded: Not even the last item fits.
    """
    items = _items(body)
    instructions, tools = body.instructions, body.tools
    history: list[InputItem] = []
    if body.previous_response_id is not None:
        _, _, _, instructions, tools = _inherit(ctx, owner, body)
        history = _conversation(ctx, owner, body.previous_response_id)
    conversation = history + items
    failure: SessionError | None = None
    for start in range(len(conversation)):
        messages = chat_messages(conversation[start:])
        if not messages:
            break
        if instructions is not None:
            messages.insert(0, {"role": "system", "content": instructions})
        plan = _plan(body, created_at, items, messages, instructions, tools)
        try:
            prompt = await ctx.manager.prompt_ids(owner, messages=messages, tools=plan.tools,
                                                  template_kwargs=plan.template_kwargs)
        except (ContextLengthExceeded, InvalidInput) as exc:  # too long, or a cut the template refuses
            failure = exc
            continue
        if len(prompt) < ctx.manager.max_model_len:
            return plan
        failure = ContextLengthExceeded(
            f"the input is {len(prompt)} tokens even without its {start} oldest items, which does not "
            f"leave room for a generated token in the model's context window of {ctx.manager.max_model_len} tokens")
    raise failure or ContextLengthExceeded("the input does not fit the model's context window")


def _plan(body: ResponseCreateRequest, created_at: int, items: list[InputItem], messages: list[Message],
          instructions: str | None, tools: list[FunctionTool] | None) -> Plan:
    effort = body.reasoning.effort if body.reasoning is not None else None
    options = GenerateOptions(
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, response_format=response_format(body),
        tool_choice=tool_choice(body), parallel_tool_calls=body.parallel_tool_calls is not False,
        tool_call_constraint=body.tool_call_constraint)
    fields = echo(body, created_at)
    context = {"instructions": instructions, "tools": [msgspec.to_builtins(t) for t in tools or ()]}

    def view(rid: str) -> str:
        stored = {**fields, "input": stored_items(rid, body, items), "context": context}
        return json.dumps(stored, separators=(",", ":"))
    return Plan(messages, chat_tools(tools), options,
                {"enable_thinking": False} if effort == "none" else None,
                view if body.store is not False else None)


def stored_output(ctx: ApiContext, owner: str, session_id: str, turn: TurnInfo,
                  record: dict[str, Any]) -> tuple[ParsedOutput, TurnInfo, tuple[int, ...]]:
    """A stored response's output, parsed again from its turn's tokens (with the request's tools
    and tool choice), the turn with its tokens, and its output token ids."""
    full = ctx.manager.turn(owner, session_id, turn.index, include_tokens=True)
    tools = chat_tools(_tools(record.get("tools") or []))
    choice = record.get("tool_choice") or "auto"
    mode = ToolChoice("none") if tools is None else (
        ToolChoice("function", choice["name"]) if isinstance(choice, dict) else ToolChoice(choice))
    parsed, output_ids = turn_output(ctx.manager.tokenizer, full, tools, mode)
    return parsed, full, output_ids


def _conversation(ctx: ApiContext, owner: str, rid: str) -> list[InputItem]:
    """Every item of the conversation that ends with response ``rid``, oldest first."""
    parts: list[list[InputItem]] = []
    next_id: str | None = rid
    while next_id is not None:
        if len(parts) >= _MAX_CHAIN:
            raise ApiError(ErrorCode.INVALID_REQUEST, f"previous_response_id: the conversation is "
                           f"longer than {_MAX_CHAIN} responses")
        session_id, turn, record = previous_turn(ctx, owner, next_id)
        parsed, _, _ = stored_output(ctx, owner, session_id, turn, record)
        output: list[InputItem] = []
        if parsed.reasoning:
            output.append(ReasoningItem(content=[ReasoningText(text=parsed.reasoning)]))
        if parsed.content:
            output.append(MessageItem(role="assistant", content=parsed.content))
        output += [FunctionCallItem(call_id=c.id, name=c.name, arguments=c.arguments)
                   for c in parsed.tool_calls]
        parts.append(decode_items(record.get("input") or []) + output)
        next_id = record.get("previous_response_id")
    return [item for part in reversed(parts) for item in part]
