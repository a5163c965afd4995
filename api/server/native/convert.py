"""Wire schemas <-> sessions types for the native API: the only place that knows both shapes.

The conversions other protocols use too (messages, tools, ``logit_bias``, ``response_format``,
``tool_choice``, ``done_event``) are ``api.server.convert``'s; these are the native API's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phloem.api.schemas import (
    AppendResult, ChatMessage, DeltaEvent, FunctionCall, GenerateParams, SessionInfo,
    TokenLogprobs, ToolCall, TopLogprob, Turn, Usage,
)
from phloem.api.server.convert import logit_bias, messages, response_format, tool_choice
from phloem.sessions import (
    GenerateOptions, GenerationResult, OutputDelta, ParsedToolCall, SessionInput, SessionSnapshot,
    TurnInfo,
)

__all__ = [
    "append_result", "delta_event", "generate_options", "session_info", "session_input",
    "tool_calls", "turn",
]





def session_input(input_ids: list[int] | None, text: str | None, chat: list[ChatMessage] | None,
                  template_kwargs: dict[str, Any] | None = None) -> SessionInput | None:
    """The one input form given (the schemas already checked there is at most one), or None."""
    if input_ids is None and text is None and chat is None:
        return None
    return SessionInput(input_ids=tuple(input_ids) if input_ids is not None else None, text=text,
                        messages=messages(chat) if chat is not None else None,
                        template_kwargs=template_kwargs)


def generate_options(params: GenerateParams | None) -> GenerateOptions | None:
    """The sessions layer's options for wire ``GenerateParams``."""
    if params is None:
        return None
    return GenerateOptions(max_tokens=params.max_tokens, temperature=params.temperature,
                           top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                           stop=tuple(params.stop), stop_token_ids=tuple(params.stop_token_ids),
                           ignore_eos=params.ignore_eos, presence_penalty=params.presence_penalty,
                           frequency_penalty=params.frequency_penalty,
                           repetition_penalty=params.repetition_penalty,
                           logit_bias=logit_bias(params.logit_bias), min_tokens=params.min_tokens,
                           logprobs=params.logprobs,
                           response_format=response_format(params.response_format),
                           tool_choice=tool_choice(params.tool_choice),
                           parallel_tool_calls=params.parallel_tool_calls,
                           tool_call_constraint=params.tool_call_constraint)


def tool_calls(calls: Sequence[ParsedToolCall]) -> list[ToolCall] | None:
    """Parsed calls as wire ``ToolCall``s (None when there are none)."""
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None


def _logprobs(r: GenerationResult) -> list[TokenLogprobs] | None:
    if not r.logprobs:
        return None
    return [TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                          top_logprobs=[TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
            for lp in r.logprobs]


def session_info(s: SessionSnapshot) -> SessionInfo:
    return SessionInfo(id=s.session_id, created_at=s.created_at, metadata=s.metadata,
                       status=s.status, num_tokens=s.num_tokens, num_turns=s.num_turns,
                       parent_id=s.parent_id, fork_turn=s.fork_turn, ttl=s.ttl)


def turn(t: TurnInfo) -> Turn:
    return Turn(index=t.index, start=t.start, end=t.end, num_output_tokens=t.num_output_tokens,
                finish_reason=t.finish_reason, created_at=t.created_at,
                token_ids=list(t.token_ids) if t.token_ids is not None else None,
                tool_calls=tool_calls(t.tool_calls))


def _usage(r: GenerationResult) -> Usage:
    return Usage(prompt_tokens=r.usage.prompt_tokens, cached_tokens=r.usage.cached_tokens,
                 completion_tokens=r.usage.completion_tokens)


def append_result(r: GenerationResult) -> AppendResult:
    assert r.turn is not None and r.num_tokens is not None, "a session generation has a turn"
    parsed = r.parsed
    return AppendResult(turn=r.turn, output_ids=list(r.output_ids), text=r.text,
                        finish_reason=r.finish_reason, usage=_usage(r), num_tokens=r.num_tokens,
                        content=parsed.content if parsed is not None else None,
                        reasoning_content=parsed.reasoning if parsed is not None else None,
                        tool_calls=tool_calls(parsed.tool_calls) if parsed is not None else None,
                        logprobs=_logprobs(r))


def delta_event(d: OutputDelta, sequence_number: int, request_id: str | None = None) -> DeltaEvent:
    return DeltaEvent(sequence_number=sequence_number, text=d.text, token_ids=list(d.token_ids),
                      request_id=request_id)
