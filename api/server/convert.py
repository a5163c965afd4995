"""Wire <-> sessions conversions that more than one protocol uses: the one place for them.

Chat messages and tools become plain dicts for the chat template, with keys whose value is
None left out (templates test ``message.tool_calls is defined``, not ``is none``); sampling and
output-shape parameters (``logit_bias``, ``response_format``, ``tool_choice``) become the
sessions layer's types; ``done_event`` is the native stream's last event, which an idempotent
replay (``context.replay``) also sends. A protocol package (``native``, ``openai``,
``responses``, ``anthropic``) keeps the conversions only it uses and imports these, never another
protocol's (an import-linter ``independence`` contract checks it).

May import: ``phloem.api.schemas`` and ``phloem.sessions``' public types; no protocol package.
"""

from __future__ import annotations

from typing import Any

import msgspec

from phloem.api.schemas import (
    AppendResult, ChatMessage, DoneEvent, ResponseFormatParam, Tool, ToolChoiceParam,
)
from phloem.sessions import Message, ResponseFormat, ToolChoice, ToolSpec

__all__ = ["done_event", "logit_bias", "messages", "response_format", "tool_choice", "tool_specs"]


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def messages(items: list[ChatMessage]) -> tuple[Message, ...]:
    """Chat messages as the template's dicts."""
    return tuple(_drop_none(msgspec.to_builtins(m)) for m in items)


def tool_specs(tools: list[Tool] | None) -> tuple[ToolSpec, ...] | None:
    """Tool definitions as the template's dicts."""
    return None if tools is None else tuple(_drop_none(msgspec.to_builtins(t)) for t in tools)


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` as ``(token_id, bias)`` pairs (the keys are digits:
    the wire schema checked them)."""
    return tuple(sorted((int(k), float(v)) for k, v in (bias or {}).items()))


def response_format(value: ResponseFormatParam | None) -> ResponseFormat | None:
    """The sessions layer's response format for the wire one (``InvalidInput`` without a schema)."""
    if value is None:
        return None
    return ResponseFormat(value.type, value.json_schema.schema if value.json_schema is not None else None)


def tool_choice(value: ToolChoiceParam) -> ToolChoice:
    """The sessions layer's tool choice for the wire one."""
    if isinstance(value, str):
        return ToolChoice(value)
    return ToolChoice("function", value.function.name)


def done_event(r: AppendResult, sequence_number: int, request_id: str | None = None) -> DoneEvent:
    return DoneEvent(sequence_number=sequence_number, turn=r.turn, output_ids=r.output_ids,
                     text=r.text, finish_reason=r.finish_reason, usage=r.usage,
                     num_tokens=r.num_tokens, request_id=request_id, content=r.content,
                     reasoning_content=r.reasoning_content, tool_calls=r.tool_calls,
                     logprobs=r.logprobs)
