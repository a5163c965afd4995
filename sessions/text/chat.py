"""Chat messages appended to a session: rendered incrementally, never re-rendering history.

A session's token ids are the source of truth; messages are only a way to produce new tokens.
Each session keeps a ``ChatContext``: the messages it was given (and one placeholder assistant
message per generated reply), its ``tools``, and whether its tokens end inside a generated
assistant message (``open_output``). Appending messages ``M`` renders text with the model's chat
template and tokenizes only that text. The exact rule:

1. **After a closed context** (``open_output`` false: the last turn was messages, or opaque
   content, see below)::

       before = render(context, add_generation_prompt=False)
       after  = render(context + M, add_generation_prompt=generate)
       new    = after[len(before):]          # `before` must be a prefix of `after`

   If the template rewrites what it rendered before (e.g. it merges a second tool result into
   the block of the first, which is already tokenized), ``before`` is not a prefix and the append
   is ``InvalidInput``: send such messages together in one append.

2. **After a generated reply** (``open_output`` true): the tokens end with the model's output,
   not with a rendered message. The context's last message, the placeholder assistant reply, is
   rendered with a one-off sentinel as its content; ``new`` is everything the template renders
   after the sentinel (the close of the reply, then ``M``, then the generation prompt if asked).
   If the output's last token is a special token that begins ``new`` (``<|im_end|>``: the model
   closed its reply itself), that part is dropped; a reply cut by ``length``, a stop string or a
   cancel is closed by the template's own closing text.

3. ``new`` is tokenized on its own and appended to the session. Nothing already in the session
   is re-tokenized. With ``escapes`` (what sessions do), special-token strings inside the
   messages are escaped before rendering and ``new`` is tokenized with
   ``Tokenizer.encode_rendered``: they stay plain text, only the template's own become control
   tokens (``sessions.text._special_text``).

**Opaque content** is raw input (``input_ids``, ``text``), and a generation that did not follow
a generation prompt (it continued from a closed message: the model may have opened a reply
itself, or not). The context cannot know what such tokens mean, so it *detaches*: a closed
placeholder assistant message is added to it, and the next messages are rendered by rule 1 as
a new block after that reply. (E.g. a tool result appended after ``append tool result`` +
``generate`` starts its own block instead of being merged into the first result's.)

A generation that follows a generation prompt, or continues an open reply, is an assistant
reply: it adds a placeholder assistant message (content ``ASSISTANT_PLACEHOLDER``) and leaves the
context open. Generated replies are never re-rendered with their real text, so templates that
treat earlier replies specially (e.g. dropping their reasoning) cannot shift the rendering.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from phloem.sessions.text._special_text import SpecialText
from phloem.sessions.errors import InvalidInput
from phloem.sessions.text.tokenizer import Message, Tokenizer, ToolSpec

__all__ = ["ASSISTANT_PLACEHOLDER", "ChatContext", "render_append"]

ASSISTANT_PLACEHOLDER = "(generated)"
"""Content of the context's assistant messages that stand for generated replies."""


@dataclass(frozen=True, slots=True)
class ChatContext:
    """What the chat template needs to render a session's next messages.

    Args:
        messages: Messages given so far, plus one placeholder per generated reply.
        tools: Tool definitions shown by the template (given at creation).
        open_output: The session's tokens end inside a generated assistant reply.
    """

    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] | None = None
    open_output: bool = False

    def with_messages(self, new: Sequence[Message]) -> ChatContext:
        """The context after ``new`` messages were appended (closed; no output yet)."""
        return replace(self, messages=self.messages + tuple(new), open_output=False)

    def with_output(self, after_generation_prompt: bool) -> ChatContext:
        """The context after a generation.

        Args:
            after_generation_prompt: The generation started right after a generation prompt,
                so its output is an assistant reply (else it is opaque, unless it continues an
                open reply).
        """
        if self.open_output:
            return self  # the reply continues
        if not after_generation_prompt:
            return self.detached()
        return replace(self, messages=self.messages + (_placeholder(),), open_output=True)

    def detached(self) -> ChatContext:
        """The context after opaque content: closed, ending with a placeholder reply."""
        last = self.messages[-1] if self.messages else None
        if last is not None and last.get("content") == ASSISTANT_PLACEHOLDER and not self.open_output:
            return self  # already detached: nothing to tell apart
        return replace(self, messages=self.messages + (_placeholder(),), open_output=False)


def _placeholder() -> Message:
    return {"role": "assistant", "content": ASSISTANT_PLACEHOLDER}


def render_append(tokenizer: Tokenizer, context: ChatContext, new: Sequence[Message], *,
                  add_generation_prompt: bool, last_token_id: int | None,
                  template_kwargs: Mapping[str, Any] | None = None,
                  escapes: SpecialText | None = None) -> str:
    """The text that appends ``new`` messages to a session (rule in the module docstring).

    Args:
        tokenizer: The model's tokenizer and chat template.
        context: The session's chat context.
        new: The messages to append (at least one).
        add_generation_prompt: End with the opening of an assistant reply.
        last_token_id: The session's last token (used when ``context.open_output``).
        template_kwargs: Extra template variables (``enable_thinking``), for every render.
        escapes: Escape special-token strings inside every message and tool with these
            markers (then tokenize the text with ``Tokenizer.encode_rendered``).

    Returns:
        The text to tokenize and append.

    Raises:
        InvalidInput: The template rejects the messages, or cannot render them as an append.
    """
    assert new, "render_append needs at least one new message"
    tools, old = context.tools, context.messages
    if escapes is not None:
        tools, old, new = escapes.escape(tools), escapes.escape(old), escapes.escape(new)
    if not context.open_output:
        before = tokenizer.render_text(old, tools=tools, template_kwargs=template_kwargs)
        after = tokenizer.render_text(tuple(old) + tuple(new), tools=tools,
                                      add_generation_prompt=add_generation_prompt,
                                      template_kwargs=template_kwargs)
        if not after.startswith(before):
            raise InvalidInput(
                "messages: the chat template renders the session's earlier messages differently "
                "once these are added (e.g. it merges consecutive tool results), so they cannot "
                "be appended; send them together in one append")
        return after[len(before):]
    sentinel = f"\u27e6phloem-{secrets.token_hex(8)}\u27e7"
    *head, last = old
    assert last.get("role") == "assistant", "an open reply's context ends with an assistant message"
    messages = (*head, {**last, "content": sentinel}, *new)
    after = tokenizer.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  template_kwargs=template_kwargs)
    cut = after.rfind(sentinel)
    if cut < 0:
        raise InvalidInput("messages: the chat template does not render assistant content, so "
                           "they cannot be appended after a generated reply")
    text = after[cut + len(sentinel):]
    if last_token_id is not None and last_token_id in tokenizer.special_token_ids:
        closing = tokenizer.decode([last_token_id], skip_special_tokens=False)
        if closing and text.startswith(closing):
            text = text[len(closing):]
    return text
