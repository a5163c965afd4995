"""Operator-declared shared prefixes (``--shared-prefix-file``): the only prefix-cache entries
every tenant may hit.

The prefix cache is partitioned by API key (``engine.cache.radix``, "Namespaces"): a request
reuses only prefixes its own key computed. An operator who serves many keys with the same system
prompt declares that prompt shared; the server computes it once at start, in the shared
namespace, and pins it for its lifetime. A request of any key whose tokens begin with it hits it
(and reports it in ``cached_tokens``); nothing a key computes below it is visible to another key.

The file is JSON Lines, one prefix per line (blank lines and lines starting with ``#`` skipped)::

    {"messages": [{"role": "system", "content": "You are a careful assistant."}]}
    {"messages": [{"role": "system", "content": "..."}], "tools": [{"type": "function", ...}]}
    {"text": "<|im_start|>system\\nRaw text, special-token strings are tokens<|im_end|>\\n"}

``messages`` (with optional ``tools``) are rendered with the model's chat template, without a
generation prompt: exactly the tokens that start a conversation with those messages. ``text`` is
tokenized as is (special-token strings become their tokens: the operator's text is trusted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SharedPrefix", "read_shared_prefix_file"]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """One shared prefix: exactly one of ``text`` and ``messages`` (``tools`` only with messages).

    Args:
        text: Raw text, tokenized as is.
        messages: Chat messages (JSON objects with ``role`` and ``content``), rendered with the
            chat template.
        tools: Tool definitions the template renders with the messages.

    Raises:
        ValueError: Not exactly one of ``text`` / ``messages``, an empty one, or ``tools``
            without ``messages``.
    """

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("shared prefix: expected exactly one of `text` and `messages`")
        if self.text is not None and not isinstance(self.text, str) or self.text == "":
            raise ValueError("shared prefix: `text` must be a non-empty string")
        if self.messages is not None and (not self.messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in self.messages)):
            raise ValueError("shared prefix: `messages` must be a non-empty list of objects with a `role`")
        if self.tools is not None and (self.messages is None or not all(isinstance(t, dict) for t in self.tools)):
            raise ValueError("shared prefix: `tools` must be a list of objects, given with `messages`")


def read_shared_prefix_file(path: Path) -> tuple[SharedPrefix, ...]:
    """Read a JSON Lines file of shared prefixes (format in the module docstring).

    Args:
        path: The file.

    Returns:
        The prefixes, in file order.

    Raises:
        ValueError: The file cannot be read, or a line is not a valid prefix (named by
            ``file:line``).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"shared_prefix_file: cannot read {path}: {exc}") from None
    prefixes = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            prefixes.append(_parse(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"shared_prefix_file: {path}:{number}: {exc}") from None
    return tuple(prefixes)


def _parse(entry: object) -> SharedPrefix:
    if not isinstance(entry, dict) or not set(entry) <= {"text", "messages", "tools"}:
        raise ValueError("expected an object with `text`, or `messages` and optional `tools`")
    messages, tools = entry.get("messages"), entry.get("tools")
    for name, value in (("messages", messages), ("tools", tools)):
        if value is not None and not isinstance(value, list):
            raise ValueError(f"`{name}` must be a list")
    return SharedPrefix(text=entry.get("text"), messages=tuple(messages) if messages is not None else None,
                        tools=tuple(tools) if tools is not None else None)
