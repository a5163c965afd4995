"""Wire schemas of the native API: requests, responses, stream events and the WebSocket protocol.

``docs/api.md`` is the reference for routes and semantics; this module is its machine-readable
half. Both the server and the SDK decode with these Structs, so a field's type and bounds are
checked identically on both sides. Every Struct forbids unknown fields (a typo is a 400, never
silently ignored) and is frozen; requests validate cross-field rules in ``__post_init__``, which
msgspec runs on decode and on construction.

NOTE: this module may import only msgspec and the standard library: the SDK depends on it and
must never pull torch or any other phloem package.
"""

from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from phloem.api._wire_agents import (
    FunctionName, JsonSchemaFormat, LogitBias, NamedToolChoice, ResponseFormatParam, TokenLogprobs,
    ToolCallConstraintParam, ToolChoiceParam, ToolName, TopLogprob,
)

__all__ = [
    "ERROR_STATUS", "PROBLEM_CONTENT_TYPE", "AppendMessage", "AppendRequest", "AppendResult",
    "CancelMessage", "CancelledEvent", "ChatMessage", "ClientMessage", "CreateSessionRequest",
    "DeltaEvent", "DoneEvent", "ErrorCode", "ErrorEvent", "FinishReason", "ForkMessage",
    "ForkRequest", "ForkResult", "ForkedEvent", "FunctionCall", "FunctionDef", "FunctionName",
    "GenerateParams", "JsonSchemaFormat", "NamedToolChoice", "OffloadRequest", "Problem",
    "ResponseFormatParam", "Role", "ServerEvent", "SessionInfo", "SessionList", "SessionStatus",
    "StreamEvent", "TokenLogprobs", "Tool", "ToolCall", "ToolChoiceParam", "TopLogprob", "Turn",
    "TurnList", "UpdateSessionRequest", "Usage", "make_problem",
]

PROBLEM_CONTENT_TYPE = "application/problem+json"


class ErrorCode(enum.StrEnum):
    """The stable ``code`` of a problem+json body or an ``error`` event (docs/api.md, Errors)."""

    INVALID_REQUEST = "invalid_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    SESSION_NOT_FOUND = "session_not_found"
    SESSION_BUSY = "session_busy"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    RATE_LIMITED = "rate_limited"
    INTERNAL_ERROR = "internal_error"
    OVERLOADED = "overloaded"


ERROR_STATUS = MappingProxyType({
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.SESSION_NOT_FOUND: 404,
    ErrorCode.SESSION_BUSY: 409,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: 400,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.IDEMPOTENCY_CONFLICT: 422,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.OVERLOADED: 503,
})
"""The HTTP status each code is sent with; one code, one status."""

SessionStatus = Literal["active", "idle", "host", "disk"]
FinishReason = Literal["stop", "length", "cancelled"]
Role = Literal["system", "user", "assistant", "tool"]

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
SessionId = Annotated[str, Meta(min_length=1, max_length=128)]
Metadata = Annotated[
    dict[Annotated[str, Meta(min_length=1, max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]
# Seconds a session stays pinned on the GPU after a turn ends (the expected tool-call gap).
Ttl = Annotated[float, Meta(ge=0, le=86_400)]
Count = Annotated[int, Meta(ge=0)]
InputIds = Annotated[list[TokenId], Meta(min_length=1)]
Text = Annotated[str, Meta(min_length=1)]


# Struct options (not a base class: msgspec applies ``kw_only`` only to a class's own fields).
_STRICT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}
_TAGGED: dict[str, Any] = {**_STRICT, "tag_field": "type"}


class FunctionCall(Struct, **_STRICT):
    name: str
    arguments: str  # JSON text, exactly as the model produced it


class ToolCall(Struct, **_STRICT):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionDef(Struct, **_STRICT):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema
    strict: bool | None = None


class Tool(Struct, **_STRICT):
    function: FunctionDef
    type: Literal["function"] = "function"


class ChatMessage(Struct, **_STRICT):
    """One chat message; rendered with the model's chat template into token ids."""

    role: Role
    content: str | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None

    def __post_init__(self) -> None:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a `{self.role}` message needs `content` or `tool_calls`")


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]


class GenerateParams(Struct, **_STRICT):
    """Sampling parameters of one generation; ``temperature == 0`` is greedy and ignores ``seed``.

    ``max_tokens=None`` generates until a stop condition or the end of the context window;
    a ``max_tokens`` beyond the window is clamped (``finish_reason == "length"``). Penalties,
    ``logit_bias``, ``min_tokens`` and ``logprobs`` mean what they mean in OpenAI's API
    (``repetition_penalty`` as in vLLM); ``response_format`` and a ``required`` or named
    ``tool_choice`` (over the session's tools) are enforced by a grammar (docs/agents.md).
    """

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=1)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=64)] = []
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    logit_bias: LogitBias | None = None
    min_tokens: Count = 0
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # alternatives per token
    response_format: ResponseFormatParam | None = None
    tool_choice: ToolChoiceParam = "auto"
    parallel_tool_calls: bool = True
    tool_call_constraint: ToolCallConstraintParam = "strict"


# Extra chat-template variables for `messages`, e.g. {"enable_thinking": false}.
TemplateKwargs = Annotated[dict[Annotated[str, Meta(min_length=1, max_length=64)], Any], Meta(max_length=16)]


def _num_inputs(body: CreateSessionRequest | AppendRequest | AppendMessage) -> int:
    """Count the input forms ``body`` gives, raising if more than one."""
    given = [name for name in ("input_ids", "messages", "text") if getattr(body, name) is not None]
    if len(given) > 1:
        raise ValueError(f"expected at most one of `input_ids`, `messages`, `text`, got {given}")
    return len(given)


class CreateSessionRequest(Struct, **_STRICT):
    """``POST /v1/sessions``. Initial content, if any, is committed (and prefilled) as turn 0."""

    metadata: Metadata = {}
    ttl: Ttl | None = None
    input_ids: InputIds | None = None
    messages: Messages | None = None
    text: Text | None = None
    tools: list[Tool] | None = None

    def __post_init__(self) -> None:
        _num_inputs(self)
        if self.tools is not None and self.messages is None:
            raise ValueError("`tools` are rendered by the chat template and need `messages`")


class UpdateSessionRequest(Struct, **_STRICT):
    """``PATCH /v1/sessions/{id}``: absent fields are unchanged; ``metadata`` replaces the map
    and ``"ttl": null`` resets the TTL to the server default."""

    metadata: Metadata | UnsetType = UNSET
    ttl: Ttl | None | UnsetType = UNSET


class AppendRequest(Struct, **_STRICT):
    """``POST /v1/sessions/{id}/append``: new input (at most one form) and an optional generation;
    with no input, ``generate`` continues from the head. ``stream`` answers with SSE events."""

    input_ids: InputIds | None = None
    messages: Messages | None = None
    text: Text | None = None
    generate: GenerateParams | None = None
    stream: bool = False
    chat_template_kwargs: TemplateKwargs | None = None

    def __post_init__(self) -> None:
        if _num_inputs(self) == 0 and self.generate is None:
            raise ValueError("expected one of `input_ids`, `messages`, `text`, or `generate`")
        if self.stream and self.generate is None:
            raise ValueError("`stream: true` needs `generate`")
        _check_template_kwargs(self)


def _check_template_kwargs(body: AppendRequest | AppendMessage) -> None:
    if body.chat_template_kwargs and body.messages is None:
        raise ValueError("`chat_template_kwargs` apply to `messages` only")


class ForkRequest(Struct, **_STRICT):
    """``POST /v1/sessions/{id}/fork``: ``n`` children holding turns ``0..at_turn`` (or all)."""

    n: Annotated[int, Meta(ge=1, le=64)] = 1
    at_turn: Count | None = None


class OffloadRequest(Struct, **_STRICT):
    """``POST /v1/sessions/{id}/offload``: spill the session's state to ``tier``."""

    tier: Literal["host", "disk"] = "host"


class Usage(Struct, **_STRICT):
    """Tokens of one generation: the whole context it saw, the cached part of it, and the output."""

    prompt_tokens: Count
    cached_tokens: Count
    completion_tokens: Count


class SessionInfo(Struct, **_STRICT):
    """A session as the API shows it; ``fork_turn`` is the parent's turn it was forked after."""

    id: SessionId
    created_at: int  # unix seconds
    metadata: Metadata
    status: SessionStatus
    num_tokens: Count
    num_turns: Count
    parent_id: SessionId | None
    fork_turn: Count | None
    ttl: Ttl


class SessionList(Struct, **_STRICT):
    """``GET /v1/sessions``: newest first; pass the last id as ``after`` while ``has_more``."""

    sessions: list[SessionInfo]
    has_more: bool


class Turn(Struct, **_STRICT):
    """Tokens ``[start, end)`` of the session; the last ``num_output_tokens`` were generated."""

    index: Count
    start: Count
    end: Count
    num_output_tokens: Count
    finish_reason: FinishReason | None
    created_at: int
    token_ids: list[TokenId] | None = None  # only with ?include_tokens=true
    tool_calls: list[ToolCall] | None = None  # parsed from the output, when it made calls


class TurnList(Struct, **_STRICT):
    turns: list[Turn]


class AppendResult(Struct, **_STRICT):
    """The committed turn: ``output_ids`` are exactly the generated tokens now in the session.

    ``text`` is the whole output; ``content``, ``reasoning_content`` and ``tool_calls`` are its
    parts (reasoning in ``<think>`` blocks, calls in the template's tool-call format: what is
    left is content), ``logprobs`` one entry per output token when asked for.
    """

    turn: Count
    output_ids: list[TokenId]
    text: str
    finish_reason: FinishReason | None  # None when nothing was generated
    usage: Usage
    num_tokens: Count  # session length after the turn
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprobs] | None = None


class ForkResult(Struct, **_STRICT):
    sessions: list[SessionInfo]


class Problem(Struct, **_STRICT):
    """An RFC 9457 problem+json body with our stable ``code``; ``request_id`` (an extension
    member) is the request's ``X-Request-Id``, to quote when reporting the error."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    request_id: str | None = None


def make_problem(code: ErrorCode, detail: str, request_id: str | None = None) -> Problem:
    """Build the problem body for ``code``.

    Args:
        code: The error code; it fixes ``status``, ``title`` and ``type``.
        detail: What was expected and what was received.
        request_id: The request's id, if known.

    Returns:
        The Problem to send with status ``ERROR_STATUS[code]``.
    """
    title = code.value.replace("_", " ").capitalize()
    return Problem(type=f"urn:phloem:error:{code.value}", title=title,
                   status=ERROR_STATUS[code], detail=detail, code=code.value, request_id=request_id)


class AppendMessage(Struct, **_TAGGED, tag="append"):
    """WebSocket: the body of ``AppendRequest`` (a generation is always streamed); the server
    echoes ``request_id`` on every event this message causes."""

    input_ids: InputIds | None = None
    messages: Messages | None = None
    text: Text | None = None
    generate: GenerateParams | None = None
    request_id: str | None = None
    chat_template_kwargs: TemplateKwargs | None = None

    def __post_init__(self) -> None:
        if _num_inputs(self) == 0 and self.generate is None:
            raise ValueError("expected one of `input_ids`, `messages`, `text`, or `generate`")
        _check_template_kwargs(self)


class CancelMessage(Struct, **_TAGGED, tag="cancel"):
    """WebSocket: stop the generation in flight; its partial output is committed."""

    request_id: str | None = None


class ForkMessage(Struct, **_TAGGED, tag="fork"):
    """WebSocket: fork the session's committed turns (allowed while a generation runs)."""

    n: Annotated[int, Meta(ge=1, le=64)] = 1
    at_turn: Count | None = None
    request_id: str | None = None


ClientMessage = AppendMessage | CancelMessage | ForkMessage


class DeltaEvent(Struct, **_TAGGED, tag="delta"):
    """New output: concatenated deltas equal the ``done`` event's ``text`` and ``output_ids``."""

    sequence_number: Count
    text: str
    token_ids: list[TokenId]
    request_id: str | None = None


class DoneEvent(Struct, **_TAGGED, tag="done"):
    """The generation ended and its turn is committed; the same fields as ``AppendResult``."""

    sequence_number: Count
    turn: Count
    output_ids: list[TokenId]
    text: str
    finish_reason: FinishReason | None
    usage: Usage
    num_tokens: Count
    request_id: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprobs] | None = None


class ErrorEvent(Struct, **_TAGGED, tag="error"):
    """A failure reported in-stream; ``code`` is an ``ErrorCode``."""

    sequence_number: Count
    code: str
    message: str
    retry_after: float | None = None
    request_id: str | None = None


class ForkedEvent(Struct, **_TAGGED, tag="forked"):
    sequence_number: Count
    sessions: list[SessionInfo]
    request_id: str | None = None


class CancelledEvent(Struct, **_TAGGED, tag="cancelled"):
    """Acknowledges a ``cancel``; sent after the cancelled generation's ``done``, if any."""

    sequence_number: Count
    request_id: str | None = None


ServerEvent = DeltaEvent | DoneEvent | ErrorEvent | ForkedEvent | CancelledEvent
StreamEvent = DeltaEvent | DoneEvent | ErrorEvent
"""The events an SSE append stream carries."""
