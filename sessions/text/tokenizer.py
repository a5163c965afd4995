"""The model's tokenizer, its chat template, and incremental detokenization with stop strings.

``Tokenizer`` wraps the Hugging Face tokenizer of a model folder (``tokenizer.json`` +
``tokenizer_config.json`` with its ``chat_template``). Text is encoded without BOS or any other
added token, and special-token strings in it (``<|im_start|>``) become those tokens; inside chat
messages they are plain text (``render_messages``, ``encode_rendered``; ``sessions.text._special_text``).
``min_tokens`` bounds from below how many tokens a text can become, from its length alone, so an
input that cannot fit the context window is refused before it is tokenized.

``IncrementalDetokenizer`` turns generated token ids into text deltas, one token at a time:

- it holds text back while the tokens end in an incomplete UTF-8 sequence (the decoded window
  ends in U+FFFD), decoding a small window ``ids[prefix_offset:]`` and emitting what grew beyond
  ``ids[prefix_offset:read_offset]`` (so tokenizers that strip a leading space when decoding a
  lone token still produce the right spaces);
- ids the tokenizer does not know (a model's vocabulary can be larger than its tokenizer's, as the
  dummy-weight shapes' is: ``runtime.model_shapes``) decode to nothing in any context, so they never
  enter the window: a run of them would otherwise grow it, and each push decode it whole again;
- it holds back a suffix of the text that could still become a stop string;
- when a stop string appears, generation should stop: ``stopped`` turns True, and the text is cut
  just before the (earliest) match. The token that completed it is part of the output.

Concatenating every ``push`` and the final ``finish`` gives exactly ``text``. Streamed and
non-streamed generations both feed tokens one by one, so both get the same text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from phloem.sessions.text._special_text import SpecialText
from phloem.sessions.errors import InvalidInput

__all__ = ["IncrementalDetokenizer", "Message", "Tokenizer", "ToolSpec"]

Message = Mapping[str, Any]
"""A chat message as the template sees it: ``role``, ``content``, optional ``tool_calls``,
``tool_call_id``, ``name`` (keys whose value would be None are left out)."""
ToolSpec = Mapping[str, Any]
"""A tool definition in OpenAI form: ``{"type": "function", "function": {...}}``."""

_REPLACEMENT = "\ufffd"
# apply_chat_template's own arguments, which a request's template variables must not override.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class Tokenizer:
    """The tokenizer and chat template of one model.

    Args:
        hf_tokenizer: A loaded Hugging Face tokenizer (fast or slow) with a chat template.
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self._hf = hf_tokenizer
        added = getattr(hf_tokenizer, "added_tokens_decoder", {})
        special = {int(i): str(t.content) for i, t in added.items() if getattr(t, "special", False)}
        self._special_ids = frozenset(set(special) | set(hf_tokenizer.all_special_ids))
        self._special_by_text = {text: i for i, text in special.items()}
        self._special_by_text.update(zip(hf_tokenizer.all_special_tokens, hf_tokenizer.all_special_ids))
        eos = hf_tokenizer.eos_token_id
        self._eos_ids = (eos,) if isinstance(eos, int) else ()
        # A copy of the fast tokenizer that reads special-token strings as plain text.
        self._plain = tokenizers.Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
        self._plain.encode_special_tokens = True
        self._chars_per_token = _max_chars_per_token(hf_tokenizer)
        self._id_limit = max(hf_tokenizer.get_vocab().values(), default=-1) + 1

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load the tokenizer of a model folder.

        Args:
            path: A Hugging Face model folder (``tokenizer.json``, ``tokenizer_config.json``).
            chat_template: A Jinja chat template used instead of the folder's (``phloem serve
                --chat-template``); the tool-call format and reasoning tags are read from it too.

        Returns:
            The tokenizer.

        Raises:
            OSError: The folder has no loadable tokenizer.
        """
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        if chat_template is not None:
            hf_tokenizer.chat_template = chat_template
        return cls(hf_tokenizer)

    @property
    def id_limit(self) -> int:
        """One past the largest id the tokenizer knows (added tokens included): every id at or past
        it decodes to nothing. Not ``len(tokenizer)``, which counts ids and so falls short of a
        vocabulary with gaps."""
        return self._id_limit

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence ids (the engine also stops on the model's own)."""
        return self._eos_ids

    @property
    def chat_template(self) -> str | None:
        """The chat template's source (its tool-call format and reasoning tags are read from it)."""
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of special tokens (skipped when decoding with ``skip_special_tokens``)."""
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text`` without BOS or other added tokens; special-token strings are kept
        as their tokens.

        Args:
            text: Any text.

        Returns:
            The token ids.
        """
        return _ids(self._hf.backend_tokenizer, text)

    @functools.cached_property
    def renders_tools_as_json(self) -> bool:
        """Whether the chat template shows each tool as its JSON (``tool | tojson``), with the
        first message: then a render holds at least the tools' compact JSON characters, a
        lower bound ``sessions._inputs.check_input_size`` counts. Probed once, with a tool
        whose strings sit at several depths (a template that drops or rewrites any of them
        gets no such bound)."""
        probe = {"type": "function", "function": {
            "name": "phloem_probe", "description": "probe description \u27e6",
            "parameters": {"type": "object", "properties": {"q": {
                "type": "string", "description": "nested", "enum": ["a", "b"]}}, "required": ["q"]}}}
        shown = json.dumps(probe, ensure_ascii=False)
        try:
            text = self.render_text([{"role": "user", "content": "x"}], tools=[probe])
        except InvalidInput:
            return False
        return shown in text

    def min_tokens(self, num_chars: int) -> int:
        """The fewest tokens a text of ``num_chars`` characters can become (0 when the
        tokenizer's normalizer gives no bound)."""
        return -(-num_chars // self._chars_per_token) if self._chars_per_token else 0

    def special_text(self) -> SpecialText:
        """Fresh markers for one chat render (``sessions.text._special_text``)."""
        return SpecialText(self._special_by_text)

    def encode_rendered(self, text: str, escapes: SpecialText) -> list[int]:
        """Tokenize a chat render whose messages were ``escapes.escape``-d: the template's own
        special-token strings become their tokens, the messages' are plain text.

        Args:
            text: The rendered text (or a part of it cut at a message boundary).
            escapes: The markers the messages were escaped with.

        Returns:
            The token ids.
        """
        ids: list[int] = []
        start = 0
        for match in escapes.specials.finditer(text) if escapes.specials else ():
            ids += self._plain_ids(escapes.restore(text[start:match.start()]))
            ids.append(self._special_by_text[match.group()])
            start = match.end()
        return ids + self._plain_ids(escapes.restore(text[start:]))

    def _plain_ids(self, text: str) -> list[int]:
        return _ids(self._plain, text) if text else []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Detokenize ``token_ids`` (ids the tokenizer does not know decode to nothing).

        Args:
            token_ids: Token ids.
            skip_special_tokens: Leave special tokens (``<|im_end|>``) out of the text.

        Returns:
            The text; incomplete UTF-8 sequences become U+FFFD.
        """
        return str(self._hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render_text(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] | None = None,
                    add_generation_prompt: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render messages with the chat template, as text.

        Args:
            messages: The conversation (an empty one renders as ``""``).
            tools: Tool definitions the template shows the model, if any.
            add_generation_prompt: Append the opening of an assistant message.
            template_kwargs: Extra template variables (``enable_thinking``); they cannot
                replace the ones above.

        Returns:
            The rendered text.

        Raises:
            InvalidInput: The template rejects the conversation (or has none).
        """
        if not messages:
            return ""
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise InvalidInput(f"chat_template_kwargs: expected template variables, got reserved {clash}")
        try:
            text = self._hf.apply_chat_template(
                [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt, tokenize=False, **extra)
        except (TemplateError, ValueError) as exc:
            raise InvalidInput(f"messages: the chat template rejected them: {exc}") from exc
        assert isinstance(text, str), f"apply_chat_template returned {type(text).__name__}"
        return text

    def render_messages(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] | None = None,
                        add_generation_prompt: bool = False,
                        template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Render a whole conversation with the chat template into token ids; special-token
        strings inside the messages and tools are plain text (``encode_rendered``).

        Args:
            messages: The conversation.
            tools: Tool definitions, if any.
            add_generation_prompt: Append the opening of an assistant message.
            template_kwargs: Extra template variables, as in ``render_text``.

        Returns:
            The token ids of the rendered text.

        Raises:
            InvalidInput: The template rejects the conversation.
        """
        escapes = self.special_text()
        text = self.render_text(escapes.escape(messages), tools=escapes.escape(tools),
                                add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
        return self.encode_rendered(text, escapes)

    def detokenizer(self, stop: Sequence[str] = ()) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer (special tokens skipped) with these stop strings."""
        return IncrementalDetokenizer(self, stop)


def _max_chars_per_token(hf_tokenizer: PreTrainedTokenizerBase) -> int:
    """Most characters of an input text one token can stand for; 0: no bound.

    A token covers at most its vocabulary entry's bytes (in UTF-8, which for byte-level BPE is
    at least the bytes it stands for), and a character is at least one byte. Normalization may
    shrink the text first: NFC / NFKC compose at most 4 characters into one (a Greek vowel with
    three marks); other normalizers (stripping accents) have no bound.
    """
    normalizer = hf_tokenizer.backend_tokenizer.normalizer
    shrink = {"NoneType": 1, "NFC": 4, "NFKC": 4}.get(type(normalizer).__name__)
    if shrink is None:
        return 0
    return shrink * max(len(t.encode()) for t in hf_tokenizer.get_vocab())


def _ids(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    # NOTE: the Rust tokenizer's ``encode`` holds the GIL throughout (seconds for a long text,
    # stalling the event loop even from a worker thread); ``encode_batch`` releases it.
    return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)


class IncrementalDetokenizer:
    """Generated token ids in, printable text deltas out (see the module docstring).

    Args:
        tokenizer: The model's tokenizer.
        stop: Stop strings; the text is cut before the earliest one that appears.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise InvalidInput(f"stop: expected non-empty strings, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._id_limit = tokenizer.id_limit
        self._stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        # Window decoding: ids[prefix_offset:read_offset] were already turned into text.
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._num_emitted = 0
        self._num_searched = 0
        self._stop_at: int | None = None
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string appeared: feed no more tokens."""
        return self._stop_at is not None

    @property
    def text(self) -> str:
        """The text so far (final after ``finish``), cut before a matched stop string."""
        return self._text if self._stop_at is None else self._text[: self._stop_at]

    def push(self, token_id: int) -> str:
        """Add one generated token.

        Args:
            token_id: The token.

        Returns:
            The text that became printable (may be empty).
        """
        assert not self.stopped and not self._finished, "push after the stop string or finish"
        if not 0 <= token_id < self._id_limit:
            return self._release(final=False)  # decodes to nothing (``Tokenizer.decode``)
        self._ids.append(token_id)
        prefix, full = self._window()
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """No more tokens: return the rest of the text (an incomplete UTF-8 tail as U+FFFD)."""
        if not self._finished and not self.stopped and self._read_offset < len(self._ids):
            prefix, full = self._window()
            self._text += full[len(prefix):]
            self._read_offset = len(self._ids)
        self._finished = True
        return self._release(final=True)

    def _window(self) -> tuple[str, str]:
        ids, decode = self._ids, self._tokenizer.decode
        return (decode(ids[self._prefix_offset:self._read_offset]),
                decode(ids[self._prefix_offset:]))

    def _release(self, final: bool) -> str:
        if self._stop_at is None and self._stop:
            self._search_stop()
        if self._stop_at is not None:
            end = self._stop_at
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._holdback()
        # A held-back suffix is never emitted, so a later match cannot start before `end`.
        delta = self._text[self._num_emitted:end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _search_stop(self) -> None:
        start = max(0, self._num_searched - self._max_stop_len + 1)
        found = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        self._num_searched = len(self._text)
        if found:
            self._stop_at = min(found)

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        for k in range(min(len(self._text), self._max_stop_len - 1), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
