"""Structured output: ``response_format`` and tool calls as a grammar for the engine.

A request gets a grammar (``engine.GrammarSpec``, an xgrammar structural tag) when

- ``tool_choice`` is ``required`` (one call or more of any of its tools; exactly one when
  ``parallel_tool_calls`` is false) or names a function (exactly one call of it): the calls
  are written in the chat template's own tool-call format (``sessions.text.tool_parsers``), their
  arguments constrained by each tool's JSON Schema, and nothing else may follow them;
- else ``response_format`` is ``json_object`` (any JSON object) or ``json_schema`` (that
  schema; ``strict`` or not, it is always enforced);
- else ``tool_choice`` is ``auto`` with tools and ``tool_call_constraint`` is not ``none``: the
  output is free text until the model writes ``<tool_call>`` (a triggered structural tag); from
  there the call must name a declared tool and, with ``strict`` (the default), its arguments
  must validate against that tool's schema (``envelope``: any JSON object); after its
  ``</tool_call>`` the text is free again (one call only when ``parallel_tool_calls`` is false).

``tool_call_constraint: none`` leaves ``auto`` free (its calls are parsed, not constrained; the
parser still drops calls to undeclared tools), ``tool_choice: none`` parses no calls, and
``text`` is no constraint.

Schemas are enforced or refused: a keyword xgrammar would silently ignore (``not``, ``allOf`` of
more than one schema, ``if`` / ``then`` / ``else``) is ``InvalidInput`` naming it, and so is a
tool whose ``parameters`` is not an object schema when its arguments are constrained. JSON has
no whitespace runs: at most one whitespace character between tokens, so ``{"a": 1, "b": 2}``
(the models' natural style) and ``{"a":1}`` fit but a model cannot pad with newlines (xgrammar's
structural-tag JSON has no separator option, only ``max_whitespace_cnt``). When the prompt leaves a ``<think>`` block open
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

__all__ = ["TOOL_CALL_CONSTRAINTS", "ResponseFormat", "ToolCallConstraint", "ToolChoice", "build_grammar",
           "output_format"]

ToolCallConstraint = Literal["none", "envelope", "strict"]
TOOL_CALL_CONSTRAINTS: tuple[ToolCallConstraint, ...] = ("none", "envelope", "strict")

# Consecutive whitespace allowed inside JSON: one (`{"a": 1, "b": 2}`), so no model (random
# weights included) can pad its output with runs of newlines and spaces.
_MAX_JSON_WHITESPACE = 1
_CALL_TAGS = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "json"),
    "qwen_xml": ("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>", "qwen_xml"),
}
_TRIGGER = "<tool_call>"
# Keywords xgrammar 0.2.9 compiles but does not enforce (it accepts output that breaks them).
_UNENFORCED = ("not", "if", "then", "else")
# Keys whose value maps names to subschemas (not keywords themselves).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Keys whose value is data, not a schema.
_DATA = ("enum", "const", "default", "examples", "required")


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
                  parallel_tool_calls: bool = True,
                  tool_call_constraint: ToolCallConstraint = "strict") -> GrammarSpec | None:
    """The grammar a generation must follow (rules in the module docstring), or None.

    Args:
        fmt: The generation's output format (template, tools, reasoning state).
        response_format: The requested format, if any.
        tool_choice: The tool choice.
        parallel_tool_calls: Whether the model may make several calls.
        tool_call_constraint: How ``auto`` constrains the calls the model opens: ``strict``
            (declared name, arguments valid against its schema), ``envelope`` (declared name,
            any JSON object) or ``none``.

    Returns:
        The grammar, or None when nothing constrains the output.

    Raises:
        InvalidInput: A forced call without tools, with a template that has no tool-call
            format, or naming a function that is not among the tools; a schema with a keyword
            the grammar cannot enforce; constrained arguments whose schema is not an object.
    """
    if tool_call_constraint not in TOOL_CALL_CONSTRAINTS:
        raise InvalidInput(f"tool_call_constraint: expected one of {list(TOOL_CALL_CONSTRAINTS)}, "
                           f"got {tool_call_constraint!r}")
    if tool_choice.mode in ("required", "function"):
        body = _forced_calls(fmt, tool_choice, parallel_tool_calls)
    elif response_format is not None and response_format.type != "text":
        schema = response_format.schema if response_format.type == "json_schema" else {"type": "object"}
        _refuse_unenforced(schema, "response_format.json_schema.schema")
        body = _json(schema)
    elif tool_choice.mode == "auto" and tool_call_constraint != "none" and fmt.parses_tools:
        body = {"type": "triggered_tags", "triggers": [_TRIGGER],
                "tags": _call_tags(fmt, _functions(fmt), strict=tool_call_constraint == "strict"),
                "at_least_one": False, "stop_after_first": not parallel_tool_calls}
    else:
        return None
    prefix = _reasoning_prefix(fmt)
    shape = body if prefix is None else {"type": "sequence", "elements": [prefix, body]}
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": shape}))


def _json(schema: Any, style: str = "json") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": style,
            "max_whitespace_cnt": _MAX_JSON_WHITESPACE}


FORCED_WITHOUT_TOOLS = "tool_choice: forcing a tool call (`required`, `any` or a named tool) needs `tools`"


def _forced_calls(fmt: OutputFormat, choice: ToolChoice, parallel: bool) -> dict[str, Any]:
    if not fmt.tools:
        raise InvalidInput(FORCED_WITHOUT_TOOLS)
    if fmt.tool_format is None:
        raise InvalidInput("tool_choice: the model's chat template has no tool-call format, so calls "
                           "cannot be forced")
    functions = _functions(fmt)
    if choice.mode == "function":
        functions = [(i, f) for i, f in functions if f.get("name") == choice.name]
        if not functions:
            raise InvalidInput(f"tool_choice: no tool is named {choice.name!r}")
    return {"type": "tags_with_separator", "tags": _call_tags(fmt, functions, strict=True), "separator": "\n",
            "at_least_one": True, "stop_after_first": choice.mode == "function" or not parallel}


def _functions(fmt: OutputFormat) -> list[tuple[int, Mapping[str, Any]]]:
    """The tools' functions with their index in ``tools``."""
    return [(i, t.get("function") or {}) for i, t in enumerate(fmt.tools)]


def _call_tags(fmt: OutputFormat, functions: Sequence[tuple[int, Mapping[str, Any]]],
               strict: bool) -> list[dict[str, Any]]:
    """One tag per function: its call in the template's format, the arguments constrained by
    its schema (``strict``) or any JSON object."""
    assert fmt.tool_format is not None
    begin, end, style = _CALL_TAGS[fmt.tool_format]
    tags = []
    for i, function in functions:
        name = str(function.get("name"))
        schema = _arguments_schema(function.get("parameters"), f"tools[{i}].function.parameters") \
            if strict else {"type": "object"}
        # JSON-quoted in the hermes format: a name is never more than a string there.
        shown = json.dumps(name, ensure_ascii=False) if fmt.tool_format == "hermes" else name
        tags.append({"type": "tag", "begin": begin.format(name=shown), "content": _json(schema, style),
                     "end": end})
    return tags


def _arguments_schema(schema: Any, where: str) -> Mapping[str, Any]:
    """A tool's ``parameters`` as the schema its arguments are constrained by: an object schema
    (``type`` absent means object), with nothing the grammar cannot enforce."""
    if schema is None or schema == {}:
        return {"type": "object"}
    if not isinstance(schema, Mapping):
        raise InvalidInput(f"{where}: expected a JSON Schema object")
    _refuse_unenforced(schema, where)
    kind = schema.get("type")
    if kind is None:
        return {**schema, "type": "object"}
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return {**schema, "type": "object"}
    raise InvalidInput(f"{where}.type: tool arguments are a JSON object, so `parameters` must be an "
                       f"object schema (`\"type\": \"object\"`), got {kind!r}")


def _refuse_unenforced(schema: Any, where: str) -> None:
    """Raise ``InvalidInput`` naming the first keyword of ``schema`` (at any depth) that the
    grammar would compile but not enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _refuse_unenforced(item, f"{where}[{i}]")
        return
    if not isinstance(schema, Mapping):
        return
    for keyword in _UNENFORCED:
        if keyword in schema:
            raise InvalidInput(f"{where}: the JSON Schema keyword `{keyword}` cannot be enforced by the "
                               "grammar; remove it")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise InvalidInput(f"{where}: the JSON Schema keyword `allOf` with more than one schema cannot be "
                           "enforced by the grammar; merge them into one schema")
    for key, value in schema.items():
        if key in _DATA:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            for name, sub in value.items():
                _refuse_unenforced(sub, f"{where}.{key}.{name}")
        elif isinstance(value, (Mapping, list)):
            _refuse_unenforced(value, f"{where}.{key}")


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
