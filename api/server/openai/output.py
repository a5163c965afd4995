"""OpenAI response pieces built from settled generations and their deltas: choices, messages,
tool calls, log-probabilities and usage, for ``/v1/chat/completions`` and ``/v1/completions``.

- A chat choice's message carries ``content``, ``reasoning_content`` (when the model reasoned)
  and ``tool_calls`` (``sessions.text.output_parser``); its ``finish_reason`` is ``tool_calls`` when
  the model stopped after making calls.
- Log-probabilities are the model's (``engine.sampling.logits_processors``): chat's ``{"content": [{token,
  logprob, bytes, top_logprobs}]}`` and completions' ``{tokens, token_logprobs, top_logprobs,
  text_offset}``. A token's text is its own decoding (a piece of a multi-byte character decodes
  to U+FFFD; ``bytes`` is that text's UTF-8).
- Usage of ``n`` choices: the prompt once, the completions summed; ``cached_tokens`` is what the
  prefix cache held before the request, and ``prompt_tokens_details.shared_tokens`` (an
  extension, ``n > 1`` only) the prompt tokens the choices shared copy-on-write instead of each
  computing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phloem.engine import TokenLogprob
from phloem.sessions import GenerationResult, OutputDelta, ParsedDelta, ParsedOutput, Tokenizer

__all__ = ["TokenTexts", "chat_delta", "chat_logprobs", "chat_message", "completion_logprobs", "finish_reason",
           "usage"]

_FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


class TokenTexts:
    """Each token's own text, decoded once per response."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling tools."""
    reason = _FINISH[result.finish_reason or "stop"]
    if reason == "stop" and result.parsed is not None and result.parsed.tool_calls:
        return "tool_calls"
    return reason


def chat_message(result: GenerationResult) -> dict[str, Any]:
    """The assistant message of one settled chat choice."""
    parsed = result.parsed or ParsedOutput(result.text or None, None)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.content is None and not parsed.tool_calls:
        message["content"] = ""
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls]
    return message


def chat_delta(delta: OutputDelta) -> dict[str, Any]:
    """A streamed chat delta: what the delta adds to the reasoning, content and tool calls."""
    parsed = delta.parsed if delta.parsed is not None else ParsedDelta(content=delta.text)
    out: dict[str, Any] = {}
    if parsed.reasoning:
        out["reasoning_content"] = parsed.reasoning
    if parsed.content:
        out["content"] = parsed.content
    if parsed.tool_calls:
        calls = []
        for c in parsed.tool_calls:
            call: dict[str, Any] = {"index": c.index, "function": {"arguments": c.arguments}}
            if c.id is not None:
                call.update(id=c.id, type="function")
                call["function"]["name"] = c.name
            calls.append(call)
        out["tool_calls"] = calls
    return out


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> dict[str, Any]:
    """Chat's ``logprobs`` object for these tokens."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
               for lp in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object for these tokens; ``offset``: the text before them."""
    tokens = [texts(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{texts(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def usage(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """The usage of a request's choices (see the module docstring)."""
    first = results[0].usage
    details: dict[str, Any] = {"cached_tokens": first.cached_tokens - first.shared_tokens}
    if len(results) > 1:
        details["shared_tokens"] = min(r.usage.shared_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion, "prompt_tokens_details": details}
