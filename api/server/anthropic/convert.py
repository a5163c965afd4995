"""Anthropic Messages <-> the sessions layer: messages, tools, options, content blocks, usage.

Requests become chat messages for the template: ``system`` a system message; a user message's
``text`` blocks a user message and each ``tool_result`` a ``tool`` message (in block order); an
assistant message's ``text`` blocks its content, its ``tool_use`` blocks its ``tool_calls``
(``input`` as JSON arguments) and its ``thinking`` its ``reasoning_content``. ``tool_choice``
``any`` is ``required``, ``tool`` a named function, ``disable_parallel_tool_use`` is
``parallel_tool_calls: false``; ``thinking`` ``enabled`` / ``disabled`` set the template's
``enable_thinking``.

Results become content blocks: ``thinking`` (the reasoning; ``signature`` empty: there is
nothing to sign), ``text`` (the content), then one ``tool_use`` per parsed call (its ``input``
the parsed arguments). ``stop_reason``: ``tool_use`` after calls, ``max_tokens`` at the limit,
``stop_sequence`` (with ``stop_sequence`` set) when one of them ended the output, else
``end_turn``. Usage follows Anthropic's split: ``input_tokens`` is the prompt tokens that were
computed, ``cache_read_input_tokens`` those the prefix cache held (their sum is the prompt).
"""

from __future__ import annotations

import json
from typing import Any

from phloem.api.server.anthropic.schemas import (
    AnthropicMessage, CustomTool, TextBlock, Thinking, ThinkingBlock, ToolChoice as ToolChoiceParam,
    ToolResultBlock, ToolUseBlock,
)
from phloem.sessions import GenerationResult, Message, ParsedOutput, ToolChoice, ToolSpec, Tokenizer

__all__ = ["chat_messages", "chat_tools", "content_blocks", "stop_reason", "template_kwargs",
           "tool_choice", "usage"]


def chat_messages(system: str | list[TextBlock] | None, messages: list[AnthropicMessage]) -> list[Message]:
    """The request as chat messages (rules in the module docstring)."""
    out: list[Message] = []
    if system:
        out.append({"role": "system", "content": _joined(system)})
    for message in messages:
        blocks = [TextBlock(text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out.append(_assistant(blocks))
            continue
        texts: list[str] = []
        for block in blocks:
            if isinstance(block, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": _joined(block.content or "")})
            elif isinstance(block, TextBlock):
                texts.append(block.text)
        if texts or not blocks:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list[Any]) -> Message:
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    return message


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def chat_tools(tools: list[CustomTool] | None) -> tuple[ToolSpec, ...] | None:
    """Custom tools in the chat template's shape (None when there are none)."""
    if not tools:
        return None
    specs = []
    for tool in tools:
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        specs.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tuple(specs)


def tool_choice(choice: ToolChoiceParam | None, has_tools: bool) -> tuple[ToolChoice, bool]:
    """The sessions layer's tool choice and ``parallel_tool_calls`` (``any`` / ``tool`` without
    tools are passed on: the sessions layer refuses them, as on every route)."""
    if choice is None or (not has_tools and choice.type in ("auto", "none")):
        return ToolChoice("auto" if has_tools else "none"), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return ToolChoice("function", choice.name), parallel
    return ToolChoice({"any": "required", "auto": "auto", "none": "none"}[choice.type]), parallel


def template_kwargs(thinking: Thinking | None) -> dict[str, Any] | None:
    """``enable_thinking`` for ``enabled`` / ``disabled`` (``adaptive``: the template's default)."""
    if thinking is None or thinking.type == "adaptive":
        return None
    return {"enable_thinking": thinking.type == "enabled"}


def content_blocks(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """The response's content blocks (order in the module docstring)."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not (parsed.reasoning or parsed.tool_calls):
        blocks.append({"type": "text", "text": parsed.content or ""})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
               for c in parsed.tool_calls]
    return blocks


def stop_reason(tokenizer: Tokenizer, result: GenerationResult, parsed: ParsedOutput,
                stop_sequences: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a settled generation."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if parsed.tool_calls:
        return "tool_use", None
    if stop_sequences and result.finish_reason == "stop":
        # The text is cut before the stop string; the tokens still hold it.
        full = tokenizer.decode(list(result.output_ids))
        for sequence in stop_sequences:
            if full.startswith(result.text + sequence):
                return "stop_sequence", sequence
    return "end_turn", None


def usage(result: GenerationResult) -> dict[str, int]:
    u = result.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}
