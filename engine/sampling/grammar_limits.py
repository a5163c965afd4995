"""What a client's grammar may cost, checked before it compiles: a clear ``InvalidRequest``.

xgrammar's compile time and memory grow much faster than the schema's text in a few constructs;
measured on the built-in model's tokenizer (4,096 tokens, one compile thread; docs/decisions.md):

    enum of 4,096 random 8-char strings (33 KB)      0.19 s    4.3 MB compiled
    enum of 8,000 random 12-char strings (96 KB)     1.2 s    28 MB (and +1 GB RSS while compiling)
    enum of 100,000 values                           114 s    +1 GB RSS (the attack in issue 47)
    one 32 KB const string                           0.22 s    9 MB
    pattern "a{1000}" / "a{2000}" / "a{4000}"        0.075 / 0.43 / 1.36 s (quadratic)
    pattern "(a{10}){100}"                           0.034 s
    200 nested objects / 50 nested objects           1.5 s / 0.03 s
    1,000 properties; anyOf of 1,000 objects         0.16 s; 0.20 s
    128 KiB of properties: 3,400 required / optional 1.1 s / 2.0 s, 12 MB (the slowest allowed)
    128 KiB of tools: 140 tools of 20 arguments      0.97 s, 9 MB
    maxLength, minItems, maxItems of 100,000         0.001-0.006 s (not unrolled: no limit)
    integer minimum/maximum of +-1e9                 0.006 s (no limit)

So a grammar is refused when its JSON text exceeds ``max_schema_bytes``, nests deeper than
``max_depth``, has an ``enum`` of more than ``max_enum_values`` values, more than
``max_literal_bytes`` of ``enum`` and ``const`` values together, or a ``pattern`` longer than
``max_pattern_bytes`` or whose repetition counts unroll past ``max_pattern_repeat``
(``GrammarConfig``). Structural tags are checked the same way over their whole document: the
tools' schemas inside them, and their ``regex`` formats' patterns. The text's size is checked
before it is parsed, so a huge schema costs nothing but its upload.
"""

from __future__ import annotations

import json
import re
from typing import Any

from phloem.engine.config import GrammarConfig
from phloem.engine.errors import InvalidRequest
from phloem.engine.sampling.params import GrammarSpec

__all__ = ["check_grammar", "pattern_repeat"]

_BOUNDS = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def check_grammar(spec: GrammarSpec, limits: GrammarConfig) -> Any:
    """The parsed JSON of ``spec``, once it is within ``limits``.

    Raises:
        InvalidRequest: one line naming the limit exceeded and the value found, or the text is
            not JSON.
    """
    what = "schema" if spec.kind == "json_schema" else "structural tag"
    size = len(spec.source.encode())
    if size > limits.max_schema_bytes:
        raise InvalidRequest(f"grammar: the {what} is {size} bytes of JSON; the limit is {limits.max_schema_bytes}")
    try:
        source = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"grammar: expected JSON text, got {spec.source[:80]!r}: {exc}") from exc
    except RecursionError:
        raise InvalidRequest(f"grammar: the {what} nests deeper than the limit of {limits.max_depth}") from None
    _Walk(limits, what).run(source)
    return source


class _Walk:
    """One pass over the document (iterative: a deep one cannot exhaust the stack)."""

    def __init__(self, limits: GrammarConfig, what: str) -> None:
        self.limits = limits
        self.what = what
        self.literal_bytes = 0

    def run(self, root: Any) -> None:
        limits = self.limits
        stack: list[tuple[Any, int]] = [(root, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > limits.max_depth:
                raise InvalidRequest(f"grammar: the {self.what} nests {depth} deep; the limit is {limits.max_depth}")
            if isinstance(node, dict):
                self._keywords(node)
                stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))

    def _keywords(self, node: dict[str, Any]) -> None:
        limits = self.limits
        enum = node.get("enum")
        if isinstance(enum, list):
            if len(enum) > limits.max_enum_values:
                raise InvalidRequest(f"grammar: an enum has {len(enum)} values; the limit is {limits.max_enum_values}")
            self._literal(sum(len(json.dumps(v)) for v in enum))
        if "const" in node:
            self._literal(len(json.dumps(node["const"])))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            if len(pattern) > limits.max_pattern_bytes:
                raise InvalidRequest(
                    f"grammar: a pattern is {len(pattern)} characters; the limit is {limits.max_pattern_bytes}"
                )
            repeat = pattern_repeat(pattern)
            if repeat > limits.max_pattern_repeat:
                raise InvalidRequest(
                    f"grammar: a pattern's repetition counts unroll to {repeat}; the limit is {limits.max_pattern_repeat}"
                )

    def _literal(self, size: int) -> None:
        self.literal_bytes += size
        if self.literal_bytes > self.limits.max_literal_bytes:
            raise InvalidRequest(
                f"grammar: the {self.what}'s enum and const values are over {self.literal_bytes} bytes of JSON; "
                f"the limit is {self.limits.max_literal_bytes}"
            )


def pattern_repeat(pattern: str) -> int:
    """How far a regular expression's ``{n}`` / ``{n,}`` / ``{n,m}`` counts unroll: each counted
    atom (a character, a class, a group) weighs its count times the weight of its inside, nested
    counts multiply, and the weights of every counted atom add up. 0 without counts."""
    # One frame per open group: [weight of its counted atoms, weight of its last atom, the part
    # of the first that the last atom (a group) brought, replaced if a count follows it].
    frames: list[list[int]] = [[0, 1, 0]]
    i, n = 0, len(pattern)
    while i < n:
        c, frame = pattern[i], frames[-1]
        if c == "(":
            frames.append([0, 1, 0])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            inner = frames.pop()
            frames[-1][0] += inner[0]
            frames[-1][1:] = [max(1, inner[0]), inner[0]]
            i += 1
            continue
        m = _BOUNDS.match(pattern, i) if c == "{" else None
        if m is not None:
            count = max(int(m.group(1)), int(m.group(2)) if m.group(2) else 0, 1)
            frame[0] += frame[1] * count - frame[2]
            frame[1:] = [1, 0]
            i = m.end()
            continue
        if c == "\\":
            i += 2
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
        frame[1:] = [1, 0]
    while len(frames) > 1:  # unbalanced: count what was open
        frames[-2][0] += frames.pop()[0]
    return frames[0][0]
