"""Request bodies of the OpenAI Responses API (``POST /v1/responses``), server side only.

They follow OpenAI's field names and shapes. ``input`` is a string or a list of items; each item
is decoded by its ``type`` into ``InputItem`` (an item with a ``role`` and no ``type`` is a
``message``, as OpenAI's "easy" input messages are), so a wrong item is a 400 naming its index.
Supported items: ``message`` (text parts), ``function_call``, ``function_call_output`` and
``reasoning``; tools: ``function`` tools only. ``user``, ``service_tier``, ``safety_identifier``,
``text.verbosity``, ``reasoning.summary`` and ``stream_options`` are accepted and ignored,
``prompt_cache_key`` is recorded (debug log); ``truncation: "auto"`` drops the oldest input
items of an input beyond the context window (``plan.plan_to_fit``); any other field is a 400, as
on the other routes (a parameter Phloem does not implement is refused, never silently dropped).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from phloem.api._wire_agents import ToolCallConstraintParam, ToolName
from phloem.api.schemas import Metadata

__all__ = [
    "FunctionCallItem", "FunctionCallOutputItem", "FunctionTool", "InputItem", "MessageItem",
    "ReasoningItem", "ResponseCreateRequest", "TextFormat", "decode_items",
]

_STRICT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}
_TAGGED: dict[str, Any] = {**_STRICT, "tag_field": "type"}
_Name = Annotated[str, Meta(min_length=1, max_length=64)]


class InputText(Struct, tag="input_text", **_TAGGED):
    text: str


class OutputText(Struct, tag="output_text", **_TAGGED):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class Refusal(Struct, tag="refusal", **_TAGGED):
    refusal: str


class ReasoningText(Struct, tag="reasoning_text", **_TAGGED):
    text: str


class SummaryText(Struct, tag="summary_text", **_TAGGED):
    text: str


class MessageItem(Struct, tag="message", **_TAGGED):
    """A message; ``developer`` is a ``system`` message, text parts are joined."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText | Refusal]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(Struct, tag="function_call", **_TAGGED):
    """A call the model made earlier (an output item sent back as input)."""

    call_id: str
    name: _Name
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Struct, tag="function_call_output", **_TAGGED):
    """A tool's result for ``call_id``."""

    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningItem(Struct, tag="reasoning", **_TAGGED):
    """Reasoning the model did earlier; its text goes with the assistant message after it."""

    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Struct, tag="function", **_TAGGED):
    name: ToolName
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class FunctionChoice(Struct, tag="function", **_TAGGED):
    name: ToolName


class FormatText(Struct, tag="text", **_TAGGED):
    pass


class FormatJsonObject(Struct, tag="json_object", **_TAGGED):
    pass


class FormatJsonSchema(Struct, tag="json_schema", **_TAGGED):
    name: _Name
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(Struct, **_STRICT):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ReasoningConfig(Struct, **_STRICT):
    """``effort: "none"`` turns a thinking template's reasoning off; the rest is accepted."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Struct, **_STRICT):
    include_obfuscation: bool | None = None  # accepted and ignored


class ResponseCreateRequest(Struct, **_STRICT):
    """``POST /v1/responses`` (docs/api.md, "Responses")."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    tool_call_constraint: ToolCallConstraintParam = "strict"  # our extension (docs/agents.md)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    # "auto": an input beyond the context window loses its oldest items (``plan.plan_to_fit``).
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None  # false only: a response runs while its request is open
    prompt_cache_key: str | None = None  # recorded (debug log): a cache/session affinity hint
    # Accepted and ignored.
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None

    def __post_init__(self) -> None:
        if self.background:
            raise ValueError("background: background responses are not supported (send false or "
                             "leave it out; stream instead)")


def decode_items(items: list[dict[str, Any]]) -> list[InputItem]:
    """``input``'s items as typed items (a ``role`` without a ``type`` is a message).

    Raises:
        ValueError: An item is not one of the supported items; the message names its index.
    """
    decoded: list[InputItem] = []
    for i, item in enumerate(items):
        if "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        try:
            decoded.append(msgspec.convert(item, InputItem))
        except msgspec.ValidationError as exc:
            raise ValueError(f"input[{i}]: {exc} (supported items: message, function_call, "
                             "function_call_output, reasoning)") from exc
    return decoded
