"""Wire schemas <-> sessions types: the only place that knows both shapes.

Chat messages and tools become plain dicts for the chat template, with keys whose value is
None left out (templates test ``message.tool_calls is defined``, not ``is none``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from phloem.api.schemas import (
    AppendResult, ChatMessage, DeltaEvent, DoneEvent, GenerateParams, SessionInfo, Tool, Turn,
    Usage,
)
from phloem.sessions import (
    GenerateOptions, GenerationResult, Message, OutputDelta, SessionInput, SessionSnapshot,
    ToolSpec, TurnInfo,
)

__all__ = [
    "append_result", "delta_event", "done_event", "generate_options", "messages", "session_info",
    "session_input", "tool_specs", "turn",
]


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


def session_input(input_ids: list[int] | None, text: str | None,
                  chat: list[ChatMessage] | None) -> SessionInput | None:
    """The one input form given (the schemas already checked there is at most one), or None."""
    if input_ids is None and text is None and chat is None:
        return None
    return SessionInput(input_ids=tuple(input_ids) if input_ids is not None else None, text=text,
                        messages=messages(chat) if chat is not None else None)


def generate_options(params: GenerateParams | None) -> GenerateOptions | None:
    """The sessions layer's options for wire ``GenerateParams``."""
    if params is None:
        return None
    return GenerateOptions(max_tokens=params.max_tokens, temperature=params.temperature,
                           top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                           stop=tuple(params.stop), stop_token_ids=tuple(params.stop_token_ids),
                           ignore_eos=params.ignore_eos)


def session_info(s: SessionSnapshot) -> SessionInfo:
    return SessionInfo(id=s.session_id, created_at=s.created_at, metadata=s.metadata,
                       status=s.status, num_tokens=s.num_tokens, num_turns=s.num_turns,
                       parent_id=s.parent_id, fork_turn=s.fork_turn, ttl=s.ttl)


def turn(t: TurnInfo) -> Turn:
    return Turn(index=t.index, start=t.start, end=t.end, num_output_tokens=t.num_output_tokens,
                finish_reason=t.finish_reason, created_at=t.created_at,
                token_ids=list(t.token_ids) if t.token_ids is not None else None)


def _usage(r: GenerationResult) -> Usage:
    return Usage(prompt_tokens=r.usage.prompt_tokens, cached_tokens=r.usage.cached_tokens,
                 completion_tokens=r.usage.completion_tokens)


def append_result(r: GenerationResult) -> AppendResult:
    assert r.turn is not None and r.num_tokens is not None, "a session generation has a turn"
    return AppendResult(turn=r.turn, output_ids=list(r.output_ids), text=r.text,
                        finish_reason=r.finish_reason, usage=_usage(r), num_tokens=r.num_tokens)


def done_event(r: AppendResult, sequence_number: int, request_id: str | None = None) -> DoneEvent:
    return DoneEvent(sequence_number=sequence_number, turn=r.turn, output_ids=r.output_ids,
                     text=r.text, finish_reason=r.finish_reason, usage=r.usage,
                     num_tokens=r.num_tokens, request_id=request_id)


def delta_event(d: OutputDelta, sequence_number: int, request_id: str | None = None) -> DeltaEvent:
    return DeltaEvent(sequence_number=sequence_number, text=d.text, token_ids=list(d.token_ids),
                      request_id=request_id)
