"""Response objects of the Responses API, built from a settled generation or a stored turn.

A response's output is read from its turn's tokens (docs/architecture.md, "Invariants": the
tokens are the source of truth): a ``reasoning`` item (the ``<think>`` text, as one ``reasoning_text`` part), a ``message``
item (the content, one ``output_text`` part; present when there is content, or when there is
nothing else), then one ``function_call`` item per parsed call, in that order. A stored
response is rebuilt from its turn the same way (``turn_output``: the output tokens are
detokenized and parsed again; the calls keep the ids stored with the turn), so ``GET`` answers
what ``POST`` did.

Status: ``completed``; ``incomplete`` (``incomplete_details.reason: max_output_tokens``) when the
output reached ``max_output_tokens`` or the context window; ``cancelled`` when the client went
away from a stream (what was generated is kept). Usage: ``input_tokens`` is the whole context
the turn saw (the conversation before it included), ``cached_tokens`` what the prefix cache or
the session already held, ``reasoning_tokens`` the output tokens up to the end of the reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from phloem.api.server.responses.input import item_id
from phloem.sessions import FinishReason, ParsedOutput, ParsedToolCall, ToolChoice, ToolSpec, Tokenizer, TurnInfo
from phloem.sessions.text.output_parser import parse_output
from phloem.sessions.text.structured import output_format

__all__ = ["call_item", "message_item", "output_items", "reasoning_item", "reasoning_tokens",
           "response_object", "status_of", "turn_output", "usage"]

_THINK_END = "</think>"


def status_of(finish_reason: FinishReason | None) -> str:
    """The response status of a generation that ended for ``finish_reason``."""
    return {"length": "incomplete", "cancelled": "cancelled"}.get(finish_reason or "stop", "completed")


def reasoning_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id(rid, "rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id(rid, "msg"), "type": "message", "role": "assistant", "status": status,
            "content": [part]}


def call_item(rid: str, index: int, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"id": item_id(rid, "fc", index), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(rid: str, parsed: ParsedOutput, status: str) -> list[dict[str, Any]]:
    """The output items of a response (order in the module docstring)."""
    item_status = "incomplete" if status != "completed" else "completed"
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(rid, parsed.reasoning, item_status))
    if parsed.content or not (parsed.reasoning or parsed.tool_calls):
        items.append(message_item(rid, parsed.content or "", item_status))
    items += [call_item(rid, i, c.id, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
    return items


def reasoning_tokens(tokenizer: Tokenizer, output_ids: Sequence[int], parsed: ParsedOutput) -> int:
    """Output tokens up to the one that closes the reasoning (all of them if it never closes)."""
    if not parsed.reasoning:
        return 0
    text = ""
    for i, token in enumerate(output_ids):
        text += tokenizer.decode([token], skip_special_tokens=False)
        if _THINK_END in text:
            return i + 1
    return len(output_ids)


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(rid: str, model: str, echo: Mapping[str, Any], status: str,
                    output: list[dict[str, Any]], usage_: dict[str, Any] | None) -> dict[str, Any]:
    """The response object: ``echo`` holds ``created_at`` and the request's fields it repeats
    (``tools``, ``instructions``, ``text``, ...; ``plan.echo``)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "status": status, "background": False, "error": None,
            "incomplete_details": incomplete, "model": model, "output": output, "usage": usage_,
            **echo}


def turn_output(tokenizer: Tokenizer, turn: TurnInfo, tools: tuple[ToolSpec, ...] | None,
                choice: ToolChoice) -> tuple[ParsedOutput, tuple[int, ...]]:
    """A stored turn's output, parsed again from its tokens (``turn.token_ids`` must be set),
    and its output token ids."""
    assert turn.token_ids is not None, "turn_output needs the turn's tokens"
    cut = len(turn.token_ids) - turn.num_output_tokens
    prompt_tail, output_ids = turn.token_ids[:cut], turn.token_ids[cut:]
    detok = tokenizer.detokenizer()
    text = "".join(detok.push(t) for t in output_ids) + detok.finish()
    parsed = parse_output(text, output_format(tokenizer, tools, prompt_tail, choice))
    calls: tuple[ParsedToolCall, ...] = turn.tool_calls
    return replace(parsed, tool_calls=calls), output_ids
