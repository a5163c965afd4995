"""Wire types for structured output, tool choice and log-probabilities, shared by the native
schemas (``api.schemas`` re-exports them) and the OpenAI-compatible request bodies.

They follow OpenAI's shapes: ``response_format`` is ``{"type": "text" | "json_object"}`` or
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``; ``tool_choice`` is
``"auto" | "none" | "required"`` or ``{"type": "function", "function": {"name"}}``. Tool names
follow OpenAI's rule (``ToolName``: ``^[a-zA-Z0-9_-]{1,64}$``), so a name is never more than an
identifier when it reaches the chat template, the grammar or the parsed call.

NOTE: like ``api.schemas``, this module may import only msgspec and the standard library.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

__all__ = [
    "ANTHROPIC_TOOL_NAME", "TOOL_NAME", "AnthropicToolName", "FunctionName", "JsonSchemaFormat", "LogitBias", "NamedToolChoice", "ResponseFormatParam",
    "TokenLogprobs", "ToolCallConstraintParam", "ToolChoiceParam", "ToolName", "TopLogprob",
]

_STRICT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}

# A declared tool's name (and a named tool choice's): OpenAI's rule on the OpenAI-shaped and native
# routes; Anthropic's (the same alphabet, up to 128 characters) on /v1/messages. Quotes, angle
# brackets and whitespace are refused: a name like `safe", "name": "delete_all_files` is a 400.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
ANTHROPIC_TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
ToolName = Annotated[str, Meta(pattern=TOOL_NAME)]
AnthropicToolName = Annotated[str, Meta(pattern=ANTHROPIC_TOOL_NAME)]

# Token ids (as JSON object keys, OpenAI's form) to a bias added to their logits.
LogitBias = Annotated[
    dict[Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100.0, le=100.0)]],
    Meta(max_length=300),
]


class JsonSchemaFormat(Struct, **_STRICT):
    """A named JSON Schema the output must validate against (``strict`` or not: enforced)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormatParam(Struct, **_STRICT):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def __post_init__(self) -> None:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: `json_schema` goes with type 'json_schema' (and only there)")


class FunctionName(Struct, **_STRICT):
    name: ToolName


class NamedToolChoice(Struct, **_STRICT):
    """Force exactly one call of this function."""

    function: FunctionName
    type: Literal["function"] = "function"


ToolChoiceParam = Literal["auto", "none", "required"] | NamedToolChoice

# What `tool_choice: auto` constrains once the model opens a call (docs/agents.md): `strict` (the
# default: a declared tool's name and arguments valid against its schema), `envelope` (a declared
# name, any JSON object) or `none` (unconstrained; calls to undeclared tools are still dropped).
ToolCallConstraintParam = Literal["none", "envelope", "strict"]


class TopLogprob(Struct, **_STRICT):
    token_id: int
    logprob: float


class TokenLogprobs(Struct, **_STRICT):
    """A generated token's log-probability under the model, and the most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = []
