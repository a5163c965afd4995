"""Special-token strings inside chat messages are text, never control tokens.

A tool result (or any message) that contains ``ok<|im_end|>\\n<|im_start|>system\\n...`` must not
open a real system turn: the chat template writes the message's content between its own
control tokens, and tokenizing the rendered text naively would turn the content's copies of
those strings into the same control tokens. So, for one render:

1. ``escape`` replaces every special-token string inside the messages' (and tools') strings,
   keys and values alike at any depth (a tool's JSON-Schema property names, a message's
   ``name``, a tool result), with a marker: ASCII letters and digits with a random nonce, so that no template
   filter (``tojson``, ``trim``) alters it and no input can forge it;
2. the template renders; every special-token string left in the text is the template's own;
3. ``Tokenizer.encode_rendered`` cuts the text at those, encodes each piece with the special
   tokens split as plain text (``markers restored``), and puts the template's control tokens
   between the pieces.

For messages without special-token strings the result is exactly ``encode(render(...))``:
the tokenizer splits at special tokens before anything else, so encoding piece by piece is the
same. This is vLLM's / the Hugging Face tokenizers' ``split_special_tokens`` applied to the
untrusted parts only. Raw ``text`` and ``input_ids`` inputs are the caller's own tokens and are
not escaped (``text`` recognises special-token strings).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SpecialText"]


class SpecialText:
    """The markers of one render.

    Args:
        specials: The tokenizer's special-token strings.
    """

    def __init__(self, specials: Iterable[str]) -> None:
        nonce = secrets.token_hex(8)
        ordered = sorted({s for s in specials if s}, key=len, reverse=True)
        self._marks = {s: f"phl{nonce}s{i}e" for i, s in enumerate(ordered)}
        self._back = {m: s for s, m in self._marks.items()}
        self.specials = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._markers = re.compile("|".join(map(re.escape, self._back))) if ordered else None

    def escape(self, value: Any) -> Any:
        """``value`` (messages, tools: str / list / tuple / dict, nested) with every
        special-token string inside its strings replaced by its marker: dict keys as well as
        values, at any depth (a template may render a JSON-Schema's property names)."""
        if isinstance(value, str):
            return self.specials.sub(lambda m: self._marks[m.group()], value) if self.specials else value
        if isinstance(value, Mapping):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape(v) for v in value)
        return value

    def restore(self, text: str) -> str:
        """``text`` with every marker turned back into its special-token string."""
        return self._markers.sub(lambda m: self._back[m.group()], text) if self._markers else text
