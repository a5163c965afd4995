"""``tool_choice: auto`` with tools is constrained once the model opens a call, schemas the
grammar cannot enforce are refused, and JSON has no whitespace runs: the structural tags
``sessions.text.structured`` builds, matched against strings by xgrammar on the built-in
tokenizer (no engine)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from transformers import AutoTokenizer

from phloem.runtime.builtin_model import trained_model_path
from phloem.sessions import InvalidInput
from phloem.sessions.text.output_parser import OutputFormat
from phloem.sessions.text.structured import ResponseFormat, ToolChoice, build_grammar

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}})
COMPILER = xgrammar.GrammarCompiler(
    xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(trained_model_path()))),
    max_threads=1)

HERMES_OK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML_OK = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
CALLS = {
    "hermes": {"ok": HERMES_OK, "undeclared": '<tool_call>\n{"name": "kv_get", "arguments": {}}\n</tool_call>',
               "bad_arguments": '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>',
               "other_object": '<tool_call>\n{"name": "get_weather", "arguments": {"x": [1]}}\n</tool_call>'},
    "qwen_xml": {"ok": XML_OK, "undeclared": "<tool_call>\n<function=kv_get>\n</function>\n</tool_call>",
                 "bad_arguments": ("<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
                                   "</function>\n</tool_call>"),
                 "other_object": ("<tool_call>\n<function=get_weather>\n<parameter=x>\n1\n</parameter>\n"
                                  "</function>\n</tool_call>")},
}


def accepts(spec: Any, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(COMPILER.compile_structural_tag(spec.source))
    return bool(matcher.accept_string(text) and matcher.is_completed())


@pytest.mark.parametrize("tool_format", ["hermes", "qwen_xml"])
def test_auto_is_free_text_until_a_call_which_must_be_declared_and_valid(tool_format: str) -> None:
    fmt = OutputFormat(tool_format, TOOLS)  # type: ignore[arg-type]
    calls = CALLS[tool_format]
    strict = build_grammar(fmt, None, ToolChoice("auto"))
    envelope = build_grammar(fmt, None, ToolChoice("auto"), tool_call_constraint="envelope")
    assert strict is not None and envelope is not None
    for spec in (strict, envelope):
        assert accepts(spec, "Just text, no call.")
        assert accepts(spec, f"Let me look. {calls['ok']}\nDone. {calls['ok']}")
        assert not accepts(spec, calls["undeclared"])
        assert not accepts(spec, "a <tool_call> that is not one")
    assert not accepts(strict, calls["bad_arguments"]) and not accepts(strict, calls["other_object"])
    assert accepts(envelope, calls["other_object"])
    single = build_grammar(fmt, None, ToolChoice("auto"), parallel_tool_calls=False)
    assert accepts(single, f"x {calls['ok']}") and not accepts(single, f"{calls['ok']}\n{calls['ok']}")
    assert build_grammar(fmt, None, ToolChoice("auto"), tool_call_constraint="none") is None


def test_auto_after_a_reasoning_block() -> None:
    fmt = OutputFormat("hermes", TOOLS, reasoning=True, starts_in_reasoning=True)
    spec = build_grammar(fmt, None, ToolChoice("auto"))
    assert accepts(spec, f"hmm <tool_call> maybe\n</think>\n\nok {HERMES_OK}")
    assert not accepts(spec, "hmm\n</think>\n\n" + CALLS["hermes"]["undeclared"])


@pytest.mark.parametrize("text, ok", [
    ('{"city": "Paris", "days": 3}', True), ('{"city":"Paris","days":3}', True),
    ('{\n  "city": "Paris"\n}', False), ('{"city"  :  "Paris"}', False), ('{"city": "Paris"}\n\n', False)])
def test_json_output_has_no_whitespace_runs(text: str, ok: bool) -> None:
    spec = build_grammar(OutputFormat(), ResponseFormat("json_schema", WEATHER), ToolChoice())
    assert accepts(spec, text) is ok


NOT = {"type": "object", "properties": {"a": {"not": {"const": 1}}}}
ALL_OF = {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "integer"}]}}}
IF = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}


@pytest.mark.parametrize("schema, keyword", [(NOT, "`not`"), (ALL_OF, "`allOf`"), (IF, "`if`")])
def test_schemas_the_grammar_cannot_enforce_are_refused(schema: dict[str, Any], keyword: str) -> None:
    tools = ({"type": "function", "function": {"name": "f", "parameters": schema}},)
    fmt = OutputFormat("hermes", tools)
    with pytest.raises(InvalidInput, match=keyword) as raised:
        build_grammar(OutputFormat(), ResponseFormat("json_schema", schema), ToolChoice())
    assert "response_format.json_schema.schema" in str(raised.value)
    for choice in (ToolChoice("required"), ToolChoice("function", "f"), ToolChoice("auto")):
        with pytest.raises(InvalidInput, match=keyword) as raised:
            build_grammar(fmt, None, choice)
        assert "tools[0].function.parameters" in str(raised.value)
    # Not constrained, not refused: `envelope` and `none` leave the arguments to the model.
    assert build_grammar(fmt, None, ToolChoice("auto"), tool_call_constraint="envelope") is not None
    assert build_grammar(fmt, None, ToolChoice("auto"), tool_call_constraint="none") is None


def test_a_keyword_name_as_a_property_or_a_value_is_not_refused() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string", "enum": ["not", "allOf"]},
                                               "if": {"type": "object", "default": {"not": 1}}}}
    assert build_grammar(OutputFormat(), ResponseFormat("json_schema", schema), ToolChoice()) is not None
    single = {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}
    assert build_grammar(OutputFormat(), ResponseFormat("json_schema", single), ToolChoice()) is not None


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array"}, {"type": ["integer", "null"]}])
def test_non_object_parameters_are_refused_when_constrained(parameters: dict[str, Any]) -> None:
    fmt = OutputFormat("qwen_xml", ({"type": "function", "function": {"name": "f", "parameters": parameters}},))
    for choice in (ToolChoice("required"), ToolChoice("auto")):
        with pytest.raises(InvalidInput, match=r"tools\[0\]\.function\.parameters\.type: .*object schema"):
            build_grammar(fmt, None, choice)
    assert build_grammar(fmt, None, ToolChoice("auto"), tool_call_constraint="envelope") is not None


def test_forcing_a_call_without_tools_has_one_message() -> None:
    for choice in (ToolChoice("required"), ToolChoice("function", "f")):
        with pytest.raises(InvalidInput, match=r"^tool_choice: forcing a tool call .* needs `tools`$"):
            build_grammar(OutputFormat("hermes"), None, choice)


def test_a_name_is_a_json_string_in_the_hermes_grammar() -> None:
    spec = build_grammar(OutputFormat("hermes", TOOLS), None, ToolChoice("required"))
    tags = json.loads(spec.source)["format"]["tags"]
    assert tags[0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
