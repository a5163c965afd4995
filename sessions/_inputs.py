"""New input of a session (token ids, text or chat messages) turned into token ids, with checks.

Token ids are checked against the model's vocabulary here, and the context window arithmetic
(docs/api.md, "Append"): with a generation the prompt must leave room for at least one new token
(``len(prompt) < max_model_len``; ``max_tokens`` is then clamped to the room left); without one
the session may fill the window exactly. ``check_input_size`` applies that arithmetic to the
fewest tokens the input can become (its length alone) before anything is rendered or tokenized,
so a multi-megabyte text, or thousands of tools, is refused at once: the characters counted are
those every render holds whole (``_num_chars``), and the tools' compact JSON when the template
shows tools as JSON (``Tokenizer.renders_tools_as_json``; HF's ``tojson`` writes at least as
many characters, ``", "`` and ``": "`` separators included); ``Tokenizer.min_tokens`` turns
characters into tokens (a token stands for at most its longest vocabulary entry's bytes). Special-token strings inside messages are plain text
(``sessions.text._special_text``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phloem.sessions.text.chat import ChatContext, render_append
from phloem.sessions.errors import ContextLengthExceeded, InvalidInput
from phloem.sessions.text.tokenizer import Message, Tokenizer, ToolSpec

__all__ = ["ResolvedInput", "SessionInput", "check_context", "check_input_size", "check_token_ids",
           "resolve_input"]


@dataclass(frozen=True, slots=True)
class SessionInput:
    """New content for a session: exactly one of ``input_ids``, ``text``, ``messages``.

    Args:
        input_ids: Token ids, appended verbatim.
        text: Text, tokenized without added tokens (special-token strings recognised).
        messages: Chat messages, rendered with the chat template as a continuation
            (``phloem.sessions.text.chat``).
        template_kwargs: Extra chat-template variables for ``messages`` (``enable_thinking``).

    Raises:
        InvalidInput: Not exactly one form is given, or it is empty, or ``template_kwargs``
            come without ``messages``.
    """

    input_ids: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[Message, ...] | None = None
    template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("input_ids", "text", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise InvalidInput(f"expected exactly one of `input_ids`, `text`, `messages`, got {given}")
        if not getattr(self, given[0]):
            raise InvalidInput(f"{given[0]}: expected a non-empty value")
        if self.template_kwargs and self.messages is None:
            raise InvalidInput("chat_template_kwargs: they apply to `messages` only")


@dataclass(frozen=True, slots=True)
class ResolvedInput:
    """Input as token ids, and the chat context once they are appended."""

    token_ids: list[int]
    chat: ChatContext
    after_generation_prompt: bool


def check_token_ids(token_ids: Sequence[int], vocab_size: int, name: str = "input_ids") -> None:
    """Raise ``InvalidInput`` unless every id is in ``[0, vocab_size)``."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"{name}: expected token ids in [0, {vocab_size}), got {bad[:5]}")


def resolve_input(tokenizer: Tokenizer, vocab_size: int, chat: ChatContext, last_token_id: int | None,
                  new: SessionInput | None, generate: bool) -> ResolvedInput:
    """Turn ``new`` into token ids appended after a session whose chat context is ``chat``.

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: The model's vocabulary size.
        chat: The session's chat context.
        last_token_id: The session's last token, if any.
        new: The input; None: nothing new (a continuation).
        generate: A generation follows (messages then end with the generation prompt).

    Returns:
        The token ids and the chat context after them.

    Raises:
        InvalidInput: A token id is out of range, or the template cannot render the messages.
    """
    if new is None:
        return ResolvedInput([], chat, chat.open_output)
    if new.input_ids is not None:
        check_token_ids(new.input_ids, vocab_size)
        return ResolvedInput(list(new.input_ids), chat.detached(), False)
    if new.text is not None:
        return ResolvedInput(tokenizer.encode(new.text), chat.detached(), False)
    assert new.messages is not None
    escapes = tokenizer.special_text()
    text = render_append(tokenizer, chat, new.messages, add_generation_prompt=generate,
                         last_token_id=last_token_id, template_kwargs=new.template_kwargs, escapes=escapes)
    ids = tokenizer.encode_rendered(text, escapes)
    check_token_ids(ids, vocab_size, "messages")
    return ResolvedInput(ids, chat.with_messages(new.messages), generate)


def _num_chars(value: object) -> int:
    """Characters of a text, or of the messages' content that every template renders whole:
    text content of non-assistant messages (templates may drop parts of earlier replies)."""
    if isinstance(value, str):
        return len(value)
    total = 0
    for message in value if isinstance(value, (list, tuple)) else ():
        if not isinstance(message, Mapping) or message.get("role") == "assistant":
            continue
        content = message.get("content")
        if content is None:
            continue
        parts = content if isinstance(content, (list, tuple)) else [content]
        total += sum(len(p) if isinstance(p, str) else len(str(p.get("text", ""))) for p in parts
                     if isinstance(p, (str, Mapping)))
    return total


def _tools_chars(tokenizer: Tokenizer, tools: Sequence[ToolSpec] | None) -> int:
    """Characters of ``tools`` every render of them holds (0 unless the template shows them as
    JSON): their compact JSON, which ``tojson`` (``", "`` / ``": "`` separators) never undercuts."""
    if not tools or not tokenizer.renders_tools_as_json:
        return 0
    return sum(len(json.dumps(t, ensure_ascii=False, separators=(",", ":"), default=str)) for t in tools)


def check_input_size(tokenizer: Tokenizer, num_tokens: int, new: SessionInput | str | object,
                     max_model_len: int, generate: bool,
                     tools: Sequence[ToolSpec] | None = None) -> None:
    """Refuse ``new`` (a session input, or a prompt's text or messages) if even its fewest
    possible tokens cannot follow ``num_tokens`` tokens.

    Args:
        tools: Tools rendered with these messages (a stateless prompt, or a session's first
            messages); they count only with messages.

    Raises:
        ContextLengthExceeded: It cannot fit (the message gives the bound).
    """
    if new is None:
        return
    if isinstance(new, SessionInput) and new.input_ids is not None:
        check_context(num_tokens + len(new.input_ids), max_model_len, generate)
        return
    if isinstance(new, SessionInput):
        new = new.text if new.text is not None else new.messages
    chars = _num_chars(new)
    if not isinstance(new, str):
        chars += _tools_chars(tokenizer, tools)
    least = tokenizer.min_tokens(chars)
    limit = max_model_len - 1 if generate else max_model_len
    if num_tokens + least > limit:
        raise ContextLengthExceeded(
            f"the input is {chars} characters, at least {least} tokens, which with the session's "
            f"{num_tokens} tokens do not fit the model's context window of {max_model_len} tokens")


def check_context(num_tokens: int, max_model_len: int, generate: bool) -> int:
    """Check that a history of ``num_tokens`` fits; return the room left for new tokens.

    Raises:
        ContextLengthExceeded: It does not fit (with ``generate``: leaves no room for a token).
        InvalidInput: ``generate`` with an empty history (nothing to continue).
    """
    if generate and num_tokens == 0:
        raise InvalidInput("nothing to generate from: the session is empty and no input was given")
    limit = max_model_len - 1 if generate else max_model_len
    if num_tokens > limit:
        need = "leave room for a generated token in" if generate else "fit"
        raise ContextLengthExceeded(
            f"the session's tokens plus the input are {num_tokens} tokens, which do not {need} "
            f"the model's context window of {max_model_len} tokens")
    return max_model_len - num_tokens
