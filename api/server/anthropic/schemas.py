"""Request bodies of the Anthropic Messages API (``POST /v1/messages``), server side only.

They follow Anthropic's field names and shapes: content blocks ``text``, ``tool_use``,
``tool_result``, ``thinking`` and ``redacted_thinking`` (images and documents are a 400);
custom tools (``name``: ``^[a-zA-Z0-9_-]{1,128}$``, Anthropic's rule; ``description``,
``input_schema``); ``tool_choice`` ``auto`` / ``any`` /
``tool`` / ``none``; ``thinking`` ``enabled`` / ``disabled`` / ``adaptive``. ``cache_control`` is
accepted on every block and tool and ignored: the prefix cache needs no breakpoints, every
request's longest cached prefix is reused. ``metadata``, ``service_tier`` and a thinking
``budget_tokens`` / ``display`` are accepted and ignored. Any other field is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from phloem.api._wire_agents import AnthropicToolName, ToolCallConstraintParam

__all__ = ["AnthropicError", "AnthropicMessage", "MessagesRequest", "TextBlock", "ThinkingBlock", "ToolResultBlock",
           "ToolUseBlock"]

_STRICT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}
_TAGGED: dict[str, Any] = {**_STRICT, "tag_field": "type"}
_Name = Annotated[str, Meta(min_length=1, max_length=64)]


class TextBlock(Struct, tag="text", **_TAGGED):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(Struct, tag="tool_use", **_TAGGED):
    id: str
    name: _Name
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Struct, tag="tool_result", **_TAGGED):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Struct, tag="thinking", **_TAGGED):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", **_TAGGED):
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class AnthropicMessage(Struct, **_STRICT):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CustomTool(Struct, **_STRICT):
    name: AnthropicToolName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(Struct, **_STRICT):
    type: Literal["auto", "any", "tool", "none"]
    name: AnthropicToolName | None = None
    disable_parallel_tool_use: bool | None = None

    def __post_init__(self) -> None:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: `name` goes with type 'tool' (and only there)")


class Thinking(Struct, **_STRICT):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None  # accepted and ignored
    display: str | None = None  # accepted and ignored


class MessagesRequest(Struct, **_STRICT):
    """``POST /v1/messages`` (docs/api.md, "Anthropic Messages")."""

    model: str
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    tool_call_constraint: ToolCallConstraintParam = "strict"  # our extension (docs/agents.md)
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = None  # accepted and ignored
    service_tier: str | None = None  # accepted and ignored
    cache_control: dict[str, Any] | None = None  # accepted and ignored


class CountTokensRequest(Struct, **_STRICT):
    """``POST /v1/messages/count_tokens``: the prompt part of ``MessagesRequest``."""

    model: str
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class AnthropicErrorDetail(Struct, **_STRICT):
    type: str
    message: str


class AnthropicError(Struct, **_STRICT):
    """Anthropic's error envelope: ``{"type": "error", "error": {"type", "message"}}``."""

    error: AnthropicErrorDetail
    type: Literal["error"] = "error"
