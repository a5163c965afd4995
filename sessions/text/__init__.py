"""Text in and out of the model: tokenizing, chat templates, and parsing what the model wrote.

Role: ``Tokenizer`` / ``IncrementalDetokenizer`` turn text into token ids and back (``tokenizer``);
``chat`` renders chat messages through the model's template into the tokens a turn appends,
with user text that looks like a special token escaped (``_special_text``); ``output_parser``
splits generated text into reasoning, content and tool calls, in the template's tool-call
format (``tool_parsers``); ``structured`` turns ``response_format`` / ``tool_choice`` into the
grammar the engine enforces; ``_tokenize_pool`` runs tokenizing and rendering off the event loop,
a bounded number per owner. Everything here is stateless per session: no session, turn, tier or
engine request.

May import: ``phloem.sessions.errors``, the engine's public ``GrammarSpec``, and nothing else of
``phloem.sessions`` (the session core and ``sessions.tiers`` build on this package, never the
reverse; the ``layers`` contract in pyproject.toml checks it). Underscored modules are private to
``phloem.sessions``.
"""

from __future__ import annotations

from phloem.sessions.text._tokenize_pool import TokenizePool
from phloem.sessions.text.chat import ChatContext, render_append
from phloem.sessions.text.output_parser import (
    OutputFormat, OutputParser, ParsedDelta, ParsedOutput, ToolCallDelta, parse_output,
)
from phloem.sessions.text.structured import ResponseFormat, ToolChoice, build_grammar, output_format
from phloem.sessions.text.tokenizer import IncrementalDetokenizer, Message, Tokenizer, ToolSpec
from phloem.sessions.text.tool_parsers import ParsedToolCall, detect_tool_format

__all__ = [
    "ChatContext", "IncrementalDetokenizer", "Message", "OutputFormat", "OutputParser",
    "ParsedDelta", "ParsedOutput", "ParsedToolCall", "ResponseFormat", "TokenizePool", "Tokenizer",
    "ToolCallDelta", "ToolChoice", "ToolSpec", "build_grammar", "detect_tool_format",
    "output_format", "parse_output", "render_append",
]
