"""Reasoning and tool calls parsed out of generated text, whole and streamed, in both formats;
and the grammars that force calls, walked with random logits on the built-in tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from phloem.engine.sampling.grammar import GrammarBackend, bitmask_width
from phloem.sessions import InvalidInput, Tokenizer
from phloem.sessions.text.output_parser import OutputFormat, OutputParser, ParsedOutput, parse_output
from phloem.sessions.text.structured import ResponseFormat, ToolChoice, build_grammar
from phloem.sessions.text.tool_parsers import detect_tool_format

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "hot": {"type": "boolean"}, "tags": {"type": "array"}}}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}})
HERMES = OutputFormat("hermes", TOOLS)
XML = OutputFormat("qwen_xml", TOOLS, reasoning=True, starts_in_reasoning=True)

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
XML_TEXT = ("The user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLa Paz\n"
            "</parameter>\n<parameter=days>\n4\n</parameter>\n<parameter=hot>\nfalse\n</parameter>\n"
            "<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>")


def calls(out: ParsedOutput) -> list[tuple[str, dict[str, object]]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def streamed(text: str, fmt: OutputFormat, seed: int) -> tuple[ParsedOutput, list[tuple[str, str]]]:
    """Feed ``text`` in random pieces; the result and the calls reassembled from the deltas."""
    rng = random.Random(seed)
    parser = OutputParser(fmt)
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        deltas.append(parser.push(text[i:i + n]))
        i += n
    deltas.append(parser.finish())
    assembled: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            entry = assembled.setdefault(c.index, ["", ""])
            entry[0] += c.name or ""
            entry[1] += c.arguments
    result = parser.result()
    assert "".join(d.content for d in deltas) == (result.content or "")
    assert "".join(d.reasoning for d in deltas) == (result.reasoning or "")
    return result, [(name, args) for name, args in assembled.values()]


def test_hermes_calls_and_their_content() -> None:
    out = parse_output(HERMES_TEXT, HERMES)
    assert out.content == "Let me check." and out.reasoning is None
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]
    assert len({c.id for c in out.tool_calls}) == 2


def test_qwen_xml_calls_are_typed_by_the_schema_after_the_reasoning() -> None:
    out = parse_output(XML_TEXT, XML)
    assert out.reasoning == "The user wants weather.\n" and out.content is None
    assert calls(out) == [("get_weather", {"city": "La Paz", "days": 4, "hot": False, "tags": ["a"]})]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(("text", "fmt"), [(HERMES_TEXT, HERMES), (XML_TEXT, XML)], ids=["hermes", "xml"])
def test_streaming_in_any_pieces_gives_the_same_parts(text: str, fmt: OutputFormat, seed: int) -> None:
    whole = parse_output(text, fmt)
    result, assembled = streamed(text, fmt, seed)
    assert (result.content, result.reasoning, calls(result)) == (whole.content, whole.reasoning, calls(whole))
    assert [(name, json.loads(args)) for name, args in assembled] == calls(whole)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city"', "<tool_call>\nnot json\n</tool_call> after",
    "a <tool_ca", "plain text\n\n",
], ids=["cut-off", "not-json", "partial-tag", "plain"])
def test_what_is_not_a_call_stays_content(text: str) -> None:
    out = parse_output(text, HERMES)
    assert out.content == text and not out.tool_calls


@pytest.mark.parametrize("fmt", [HERMES, XML], ids=["hermes", "qwen_xml"])
def test_a_call_to_an_undeclared_tool_stays_content(fmt: OutputFormat) -> None:
    prefix = "x\n</think>\n\n" if fmt.starts_in_reasoning else ""
    body = ('{"name": "delete_all_files", "arguments": {}}' if fmt is HERMES
            else "<function=delete_all_files>\n</function>")
    text = f"{prefix}<tool_call>\n{body}\n</tool_call>"
    for seed in range(5):
        out, deltas = streamed(text, fmt, seed)
        assert out.tool_calls == () and deltas == []
        assert out.content == f"<tool_call>\n{body}\n</tool_call>"


def test_without_tools_or_format_nothing_is_parsed() -> None:
    assert parse_output(HERMES_TEXT, OutputFormat("hermes", ())).content == HERMES_TEXT
    assert parse_output(HERMES_TEXT, OutputFormat(None, TOOLS)).content == HERMES_TEXT


@pytest.mark.parametrize(("text", "fmt", "reasoning", "content"), [
    ("<think>\nhmm\n</think>\n\nHello", OutputFormat(reasoning=True), "\nhmm\n", "Hello"),
    ("  <think>x</think>y", OutputFormat(reasoning=True), "x", "y"),
    ("no thinking here", OutputFormat(reasoning=True), None, "no thinking here"),
    ("still thinking", OutputFormat(reasoning=True, starts_in_reasoning=True), "still thinking", None),
    ("<think>x</think>y", OutputFormat(), None, "<think>x</think>y"),
], ids=["block", "leading-space", "none", "unclosed", "template-without-think"])
def test_reasoning_blocks(text: str, fmt: OutputFormat, reasoning: str | None, content: str | None) -> None:
    out = parse_output(text, fmt)
    assert (out.reasoning, out.content) == (reasoning, content)
    result, _ = streamed(text, fmt, 1)
    assert (result.reasoning, result.content) == (reasoning, content)


def test_the_template_picks_the_format(tmp_path: Path, tokenizer: Tokenizer) -> None:
    assert detect_tool_format(tokenizer.chat_template) == "hermes"
    assert detect_tool_format("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' }}") == "qwen_xml"
    assert detect_tool_format("{{ messages }}") is None and detect_tool_format(None) is None


def walk(backend: GrammarBackend, spec_source: object, seed: int, steps: int = 800) -> list[int]:
    """Random logits masked by the grammar until it terminates: what a random model writes."""
    assert spec_source is not None
    matcher = backend.matcher(spec_source)  # type: ignore[arg-type]
    mask = torch.zeros((1, bitmask_width(backend.vocab_size)), dtype=torch.int32)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        matcher.fill(mask, 0)
        allowed = ((mask[0].unsqueeze(-1) >> torch.arange(32)) & 1).reshape(-1)[:backend.vocab_size].bool()
        logits = torch.randn(backend.vocab_size, generator=generator).masked_fill(~allowed, float("-inf"))
        token = int(logits.argmax())
        assert matcher.accept(token)
        if matcher.is_terminated:
            return out
        out.append(token)
    raise AssertionError("the grammar did not terminate")


BOUNDED = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
BOUNDED_TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED}},
                 {"type": "function", "function": {"name": "flag", "parameters": {
                     "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}})


@pytest.mark.parametrize("tool_format", ["hermes", "qwen_xml"])
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "flag")], ids=["required", "named"])
def test_forced_calls_parse_and_validate_under_random_logits(
        tool_format: str, choice: ToolChoice, model_dir: Path, tokenizer: Tokenizer) -> None:
    backend = GrammarBackend(model_dir, 1920, (2,))
    fmt = OutputFormat(tool_format, BOUNDED_TOOLS)  # type: ignore[arg-type]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    for seed in range(4):
        spec = build_grammar(fmt, ResponseFormat("json_object"), choice, parallel_tool_calls=False)
        out = parse_output(tokenizer.decode(walk(backend, spec, seed)), fmt)
        [call] = out.tool_calls
        assert choice.name in (None, call.name) and out.content is None
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_response_format_and_the_cases_without_a_grammar(model_dir: Path, tokenizer: Tokenizer) -> None:
    backend = GrammarBackend(model_dir, 1920, (2,))
    spec = build_grammar(OutputFormat(), ResponseFormat("json_schema", BOUNDED), ToolChoice())
    jsonschema.validate(json.loads(tokenizer.decode(walk(backend, spec, 0))), BOUNDED)
    # `auto` with tools is constrained by default (tests/sessions/test_tool_call_constraint.py);
    # `tool_call_constraint: none` leaves it free, as `auto` was before it.
    assert build_grammar(HERMES, ResponseFormat("text"), ToolChoice("auto"), tool_call_constraint="none") is None
    assert build_grammar(OutputFormat("hermes"), ResponseFormat("text"), ToolChoice("auto")) is None
    assert build_grammar(HERMES, None, ToolChoice("none")) is None
    with pytest.raises(InvalidInput, match="needs `tools`"):
        build_grammar(OutputFormat("hermes"), None, ToolChoice("required"))
    with pytest.raises(InvalidInput, match="no tool-call format"):
        build_grammar(OutputFormat(None, TOOLS), None, ToolChoice("required"))
    with pytest.raises(InvalidInput, match="no tool is named"):
        build_grammar(HERMES, None, ToolChoice("function", "missing"))
