"""Request bodies of the OpenAI-compatible routes (server side only; responses are plain dicts,
except the error envelope, described here for the OpenAPI schema).

They follow OpenAI's field names and defaults (``max_tokens`` 16 for completions, ``temperature``
1), plus the common extensions ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``,
``repetition_penalty`` and ``chat_template_kwargs`` (vLLM's names). ``metadata``, ``store``,
``user`` and ``service_tier`` are accepted and ignored: they have no meaning for a local server;
so are chat's ``safety_identifier`` and ``verbosity``. Chat's ``reasoning_effort`` sets the chat
template's ``enable_thinking`` and ``prompt_cache_key`` is recorded (docs/api.md).
As on the native routes, an unknown field is a 400: a parameter we do not implement is refused
rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from phloem.api._wire_agents import LogitBias, ResponseFormatParam, ToolCallConstraintParam, ToolChoiceParam
from phloem.api.schemas import Tool, ToolCall

__all__ = ["ChatCompletionRequest", "CompletionRequest", "OpenAIError", "OpenAIErrorDetail",
           "OpenAIMessage", "StreamOptions", "TextPart"]

_STRICT: dict[str, Any] = {"forbid_unknown_fields": True, "kw_only": True, "frozen": True}

Stop = str | Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)] | None


class OpenAIErrorDetail(Struct, **_STRICT):
    message: str
    type: str
    param: str | None
    code: str


class OpenAIError(Struct, **_STRICT):
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: OpenAIErrorDetail


class StreamOptions(Struct, **_STRICT):
    include_usage: bool = False


class TextPart(Struct, **_STRICT):
    text: str
    type: Literal["text"] = "text"


class OpenAIMessage(Struct, **_STRICT):
    """A chat message; ``content`` may be text parts, which are joined (other parts: 400)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    model: str
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=1)] | None = None  # None: no top-k (as the native API)
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=64)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Choices of one prompt: forks that share its prefill (``SessionManager.complete``).
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: LogitBias | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    # Accepted and ignored.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class ChatCompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[OpenAIMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None  # None: auto
    parallel_tool_calls: bool | None = None
    tool_call_constraint: ToolCallConstraintParam = "strict"  # our extension (docs/agents.md)
    response_format: ResponseFormatParam | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = None  # accepted and ignored
    # The template's thinking switch (``enable_thinking``): off for "none"/"minimal", else on;
    # an ``enable_thinking`` in ``chat_template_kwargs`` wins.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # A cache/session affinity hint: recorded (debug log), not needed for hits (see docs/api.md).
    prompt_cache_key: Annotated[str, Meta(max_length=1024)] | None = None
    safety_identifier: Annotated[str, Meta(max_length=1024)] | None = None  # accepted and ignored
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored

    def __post_init__(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs `logprobs: true`")


class CompletionRequest(_Sampling, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """``POST /v1/completions``: ``prompt`` is text or token ids (or a batch of exactly one)."""

    prompt: str | list[Any]
    max_tokens: Annotated[int, Meta(ge=1)] | None = 16
    # The sampled token's log-probability and this many alternatives (OpenAI allows up to 5).
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    # vLLM's extension: each choice (and each stream chunk) also carries its token ids, so a
    # client that sends token-id prompts can extend its history exactly.
    return_token_ids: bool = False
