"""A generation's text split into reasoning, content and tool calls, as it streams.

``OutputParser`` takes the detokenized text delta by delta and returns what each delta adds to
the three parts; ``parse_output`` feeds a whole text through the same machine, so a streamed
and a non-streamed generation of the same text give the same parts::

    [<think>] reasoning </think> \\n\\n content <tool_call> call </tool_call> \\n <tool_call> ...
    |<------ reasoning ------>|       |content|<----- tool call 0 ---->|      |<-- call 1 ...

- Reasoning is split only for a model whose chat template uses ``<think>``
  (``OutputFormat.reasoning``): from the start of the output when the prompt left a ``<think>``
  block open (``starts_in_reasoning``: the template's thinking mode), or when the output itself
  begins with ``<think>``; it ends at ``</think>`` (the newlines after it are dropped). An
  unclosed block is all reasoning.
- Tool calls are parsed only when the request has tools and the template a tool-call format
  (``sessions.text.tool_parsers``). A call is reported when its ``</tool_call>`` arrives, as two
  deltas: its id and name (``arguments`` empty), then its arguments. A block that does not
  parse, names a tool the request did not declare, or is cut off, stays in the content as text:
  a call to an undeclared name is never reported (the grammar keeps the model from writing one
  unless ``tool_call_constraint`` is ``none``). Whitespace before, between and after
  calls is not content (trailing whitespace is held back until non-whitespace text follows).
- Text that may be the start of a tag (``<tool_`` at the end of a delta) is held back until the
  next delta decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phloem.sessions.text.tokenizer import ToolSpec
from phloem.sessions.text.tool_parsers import (
    TOOL_CALL_END, TOOL_CALL_START, ParsedToolCall, ToolFormat, parse_call,
)

__all__ = ["OutputFormat", "OutputParser", "ParsedDelta", "ParsedOutput", "ToolCallDelta", "parse_output"]

_THINK_START = "<think>"
_THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """How to read one generation's text (see the module docstring).

    Args:
        tool_format: The template's tool-call format; None: never parse calls.
        tools: The request's tools (XML values are typed by their schemas); empty: no parsing.
        reasoning: The template uses ``<think>`` blocks.
        starts_in_reasoning: The prompt ends inside an open ``<think>`` block.
    """

    tool_format: ToolFormat | None = None
    tools: tuple[ToolSpec, ...] = ()
    reasoning: bool = False
    starts_in_reasoning: bool = False

    @property
    def parses_tools(self) -> bool:
        return self.tool_format is not None and bool(self.tools)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call ``index``: the first has its ``id`` and ``name``; ``arguments``
    pieces concatenate to its JSON arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """The whole output's parts; ``None`` for a part that is empty."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ParsedToolCall, ...] = ()


@dataclass
class _Parts:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[ParsedToolCall] = field(default_factory=list)


class OutputParser:
    """Streaming parser of one generation (see the module docstring)."""

    def __init__(self, fmt: OutputFormat) -> None:
        self._fmt = fmt
        self._mode = "reasoning" if fmt.reasoning and fmt.starts_in_reasoning else "content"
        self._at_start = fmt.reasoning and not fmt.starts_in_reasoning
        self._after_think = False
        self._buf = ""
        self._ws = ""  # trailing whitespace held back: dropped if a tool call follows
        self._parts = _Parts()
        self._declared = frozenset(str((t.get("function") or {}).get("name")) for t in fmt.tools)

    def push(self, text: str) -> ParsedDelta:
        """Add a text delta; return what it completes."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        """No more text: return the rest."""
        return self._run(final=True)

    def result(self) -> ParsedOutput:
        """Every part so far (after ``finish``: the whole output)."""
        p = self._parts
        return ParsedOutput("".join(p.content) or None, "".join(p.reasoning) or None, tuple(p.calls))

    def _run(self, final: bool) -> ParsedDelta:
        reasoning, content, calls = [], [], []
        while True:
            before = (self._mode, len(self._buf))
            if self._mode == "reasoning":
                reasoning.append(self._reasoning(final))
            elif self._mode == "call":
                piece = self._call(final)
                if isinstance(piece, tuple):
                    calls.extend(piece)
                else:
                    content.append(piece)
            else:
                content.append(self._content(final))
            if (self._mode, len(self._buf)) == before:
                break
        if final and self._mode == "content" and self._ws and not self._parts.calls:
            content.append(self._ws)
            self._ws = ""
        delta = ParsedDelta("".join(reasoning), "".join(content), tuple(calls))
        self._parts.reasoning.append(delta.reasoning)
        self._parts.content.append(delta.content)
        return delta

    def _reasoning(self, final: bool) -> str:
        end = self._buf.find(_THINK_END)
        if end >= 0:
            text, self._buf = self._buf[:end], self._buf[end + len(_THINK_END):]
            self._mode, self._after_think = "content", True
            return text
        keep = 0 if final else _partial_suffix(self._buf, _THINK_END)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return text

    def _content(self, final: bool) -> str:
        if self._at_start:
            head = self._buf.lstrip()
            if not final and len(head) < len(_THINK_START) and _THINK_START.startswith(head):
                return ""  # may still open a reasoning block
            self._at_start = False
            if head.startswith(_THINK_START):
                self._buf, self._mode = head[len(_THINK_START):], "reasoning"
                return ""
        if self._after_think:
            self._buf = self._buf.lstrip("\n")
            if not self._buf and not final:
                return ""
            self._after_think = False
        if not self._fmt.parses_tools:
            text, self._buf = self._buf, ""
            return text
        start = self._buf.find(TOOL_CALL_START)
        if start >= 0:
            text, self._buf = self._buf[:start], self._buf[start + len(TOOL_CALL_START):]
            self._mode = "call"
            out = self._hold_ws(text)
            self._ws = ""  # whitespace before a call is not content
            return out
        keep = 0 if final else _partial_suffix(self._buf, TOOL_CALL_START)
        text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return self._hold_ws(text)

    def _hold_ws(self, text: str) -> str:
        """``text`` without its trailing whitespace, which waits for what follows it."""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        return body

    def _call(self, final: bool) -> tuple[ToolCallDelta, ...] | str:
        end = self._buf.find(TOOL_CALL_END)
        if end < 0:
            if not final:
                return ()
            # Cut off before its end: not a call, its text stays content.
            text, self._buf, self._mode = TOOL_CALL_START + self._buf, "", "content"
            return text
        body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_END):]
        self._mode = "content"
        assert self._fmt.tool_format is not None
        call = parse_call(self._fmt.tool_format, body, self._fmt.tools)
        if call is None or call.name not in self._declared:
            return TOOL_CALL_START + body + TOOL_CALL_END
        index = len(self._parts.calls)
        self._parts.calls.append(call)
        return (ToolCallDelta(index, call.id, call.name, ""), ToolCallDelta(index, None, None, call.arguments))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parse_output(text: str, fmt: OutputFormat) -> ParsedOutput:
    """The parts of a whole output (the same as streaming it through ``OutputParser``)."""
    parser = OutputParser(fmt)
    parser.push(text)
    parser.finish()
    return parser.result()
