"""The tool-call formats of the chat templates we serve, and parsing one call into OpenAI form.

Both formats wrap each call in ``<tool_call>`` ... ``</tool_call>``; what is inside differs:

- ``hermes`` (Qwen3, Qwen3-Next, the built-in models): one JSON object::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``qwen_xml`` (Qwen3.5, Qwen3-Coder): a function block of parameters, each value raw text
  (strings) or JSON (everything else)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

The format is chosen by the model's chat template (``detect_tool_format``): the one it renders
assistant tool calls in. A block that does not parse is not a call (the caller keeps it as
text). ``arguments`` is always JSON text; XML parameter values are converted with the type
their tool's JSON Schema gives them (``integer``, ``number``, ``boolean``, ``object``,
``array``; else they stay strings); whitespace around a value is layout and dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from phloem.sessions.text.tokenizer import ToolSpec

__all__ = [
    "TOOL_CALL_END", "TOOL_CALL_START", "ParsedToolCall", "ToolFormat", "detect_tool_format",
    "new_call_id", "parse_call",
]

ToolFormat = Literal["hermes", "qwen_xml"]
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_SCALARS = {"integer": int, "number": float}


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call in OpenAI's shape: ``arguments`` is JSON text of an object."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A fresh OpenAI-style call id (``call_`` + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


def detect_tool_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format ``chat_template`` renders, or None when it renders no tool calls."""
    if not chat_template:
        return None
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen_xml"
    if TOOL_CALL_START in chat_template:
        return "hermes"
    return None


def parse_call(fmt: ToolFormat, body: str, tools: Sequence[ToolSpec]) -> ParsedToolCall | None:
    """The call in ``body`` (the text between the tags), or None when it is not one."""
    if fmt == "hermes":
        return _parse_hermes(body)
    return _parse_xml(body, tools)


def _parse_hermes(body: str) -> ParsedToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_xml(body: str, tools: Sequence[ToolSpec]) -> ParsedToolCall | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    if _PARAMETER.sub("", inner).strip():
        return None  # text outside the parameter blocks: not this format
    properties = _properties(tools, name)
    # The template puts each value on its own lines, and the grammar lets whitespace surround
    # it: whitespace around a value is layout, not part of it.
    arguments = {key.strip(): _convert(raw.strip(), properties.get(key.strip()))
                 for key, raw in _PARAMETER.findall(inner)}
    return ParsedToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _properties(tools: Sequence[ToolSpec], name: str) -> Mapping[str, Any]:
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _convert(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's value by its schema type; strings (and what does not convert) stay text."""
    types = (schema or {}).get("type")
    kinds = set(types) if isinstance(types, list) else {types} if types else set()
    if not kinds or "string" in kinds:
        return raw
    for kind in ("integer", "number"):
        if kind in kinds:
            try:
                return _SCALARS[kind](raw)
            except ValueError:
                pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
