"""Grammars of every kind the engine constrains to, for the constrained-decoding tests: a JSON
Schema, a regular expression and forced tool calls in both chat-template formats (the structural
tags ``sessions.text.structured`` builds), each bounded so that random weights reach its end."""

from __future__ import annotations

import json

from phloem.engine import GrammarSpec
from phloem.sessions.text.output_parser import OutputFormat
from phloem.sessions.text.structured import ToolChoice, build_grammar

__all__ = ["HERMES", "JSON", "REGEX", "SCHEMA", "TOOLS", "TOOL_CALL", "WEATHER", "XML", "XML_CALL"]

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "unit": {"enum": ["kg", "lb"]}}, "required": ["ok", "n", "unit"], "additionalProperties": False}
JSON = GrammarSpec("json_schema", json.dumps(SCHEMA))
REGEX = GrammarSpec("structural_tag", json.dumps(
    {"type": "structural_tag", "format": {"type": "regex", "pattern": "[a-z]{2,5}( [0-9]{1,2}){1,3}\\."}}))
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "flag", "parameters": {
             "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}})
HERMES = OutputFormat("hermes", TOOLS)
XML = OutputFormat("qwen_xml", TOOLS)
TOOL_CALL = build_grammar(HERMES, None, ToolChoice("required"), parallel_tool_calls=False)
XML_CALL = build_grammar(XML, None, ToolChoice("function", "flag"))
