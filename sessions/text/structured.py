"""Structured output: ``response_format`` and forced tool calls as a grammar for the engine.

A request gets a grammar (``engine.GrammarSpec``, an xgrammar structural tag) when

- ``tool_choice`` is ``required`` (one call or more of any of its tools; exactly one when
  ``parallel_tool_calls`` is false) or names a function (exactly one call of it): the calls
  are written in the chat template's own tool-call format (``sessions.text.tool_parsers``), their
  arguments constrained by each tool's JSON Schema, and nothing else may follow them;
- else ``response_format`` is ``json_object`` (any JSON object) or ``json_schema`` (that
  schema; ``strict`` or not, it is always enforced).

``tool_choice: auto`` leaves the model free (its calls are parsed, not forced) and ``none`` too
(no calls are parsed); ``text`` is no constraint. When the prompt leaves a ``<think>`` block open
(a thinking template), the grammar first lets the model finish its reasoning up to
``</think>``; when the template thinks but the prompt does not open a block, an optional
``<think>`` block may come first. Random weights therefore still produce a call or a document
that parses and validates, which is how the tests check it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from phloem.engine import GrammarSpec
from phloem.sessions.errors import InvalidInput
from phloem.sessions.text.output_parser import OutputFormat
from phloem.sessions.text.tokenizer import Tokenizer, ToolSpec
from phloem.sessions.text.tool_parsers import detect_tool_format

__all__ = ["ResponseFormat", "ToolChoice", "build_grammar", "output_format"]

# Consecutive whitespace allowed inside JSON: pretty-printed JSON nested seven levels at indent 2
# fits, and no model (random weights included) can loop on whitespace forever.
_MAX_JSON_WHITESPACE = 16
_CALL_TAGS = {
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "json"),
    "qwen_xml": ("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>", "qwen_xml"),
}


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (``schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and not isinstance(self.schema, Mapping):
            raise InvalidInput("response_format.json_schema.schema: expected a JSON Schema object")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """``auto``, ``none``, ``required``, or ``function`` with the ``name`` to call."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "function") != (self.name is not None):
            raise InvalidInput("tool_choice: a function name goes with mode 'function' only")


def output_format(tokenizer: Tokenizer, tools: Sequence[ToolSpec] | None, prompt_ids: Sequence[int],
                  tool_choice: ToolChoice) -> OutputFormat:
    """How to read (and constrain) a generation that continues ``prompt_ids``.

    Args:
        tokenizer: The model's tokenizer; its chat template picks the tool-call format and
            says whether the model reasons in ``<think>`` blocks.
        tools: The tools the prompt shows the model.
        prompt_ids: The whole prompt; a ``<think>`` at its end means the output starts inside
            a reasoning block.
        tool_choice: ``none`` turns tool-call parsing off.

    Returns:
        The output format.
    """
    template = tokenizer.chat_template
    reasoning = template is not None and "<think>" in template
    tail = tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False) if reasoning else ""
    return OutputFormat(tool_format=detect_tool_format(template),
                        tools=tuple(tools or ()) if tool_choice.mode != "none" else (),
                        reasoning=reasoning, starts_in_reasoning=tail.rstrip().endswith("<think>"))


def build_grammar(fmt: OutputFormat, response_format: ResponseFormat | None, tool_choice: ToolChoice,
                  parallel_tool_calls: bool = True) -> GrammarSpec | None:
    """The grammar a generation must follow (rules in the module docstring), or None.

    Args:
        fmt: The generation's output format (template, tools, reasoning state).
        response_format: The requested format, if any.
        tool_choice: The tool choice.
        parallel_tool_calls: Whether ``required`` may make several calls.

    Returns:
        The grammar, or None when nothing constrains the output.

    Raises:
        InvalidInput: A forced call without tools, with a template that has no tool-call
            format, or naming a function that is not among the tools.
    """
    if tool_choice.mode in ("required", "function"):
        body = _forced_calls(fmt, tool_choice, parallel_tool_calls)
    elif response_format is not None and response_format.type != "text":
        schema = response_format.schema if response_format.type == "json_schema" else {"type": "object"}
        body = _json(schema)
    else:
        return None
    prefix = _reasoning_prefix(fmt)
    shape = body if prefix is None else {"type": "sequence", "elements": [prefix, body]}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": shape}))


def _json(schema: Any, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": style,
            "max_whitespace_cnt": _MAX_JSON_WHITESPACE}


def _forced_calls(fmt: OutputFormat, choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    if not fmt.tools:
        raise InvalidInput(f"tool_choice: {choice.mode!r} needs `tools`")
    if fmt.tool_format is None:
        raise InvalidInput("tool_choice: the model's chat template has no tool-call format, so calls "
                           "cannot be forced")
    functions = [t.get("function") or {} for t in fmt.tools]
    if choice.mode == "function":
        functions = [f for f in functions if f.get("name") == choice.name]
        if not functions:
            raise InvalidInput(f"tool_choice: no tool is named {choice.name!r}")
    begin, end, style = _CALL_TAGS[fmt.tool_format]
    tags = [{"type": "tag", "begin": begin.format(name=f["name"]),
             "content": _json(f.get("parameters") or {"type": "object"}, style), "end": end}
            for f in functions]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": choice.mode == "function" or not parallel}


def _reasoning_prefix(fmt: OutputFormat) -> dict[str, Any] | None:
    if not fmt.reasoning:
        return None
    text = {"type": "any_text", "excludes": ["<think>", "</think>"]}
    if fmt.starts_in_reasoning:
        block = {"type": "tag", "begin": "", "content": text, "end": "</think>"}
        return {"type": "sequence", "elements": [block, {"type": "const_string", "value": "\n\n"}]}
    block = {"type": "tag", "begin": "<think>", "content": text, "end": "</think>"}
    return {"type": "optional", "content": {
        "type": "sequence", "elements": [block, {"type": "const_string", "value": "\n\n"}]}}
