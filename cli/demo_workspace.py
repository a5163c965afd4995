"""The make-believe coding workspace that ``phloem demo``'s agent works in.

The demo declares three tools, ``list_files``, ``read_file`` and ``run_tests``, with the schemas
of ``docs/examples/agent.py`` — the ones the trained built-in model saw in its corpus
(``tools/train/prepare.py``) — and answers the model's calls with canned results from a
two-file workspace holding one off-by-one bug. Nothing runs: ``run_tests`` passes when the
proposed line is the right fix and fails otherwise, so a model's line is compared, never executed.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["FIXES", "SYSTEM_PROMPT", "TASK", "TOOLS", "call_text", "tool_result"]

SYSTEM_PROMPT = "You are a careful coding agent. Use the tools, read their results, then answer."
TASK = "The test in test_stats.py fails. Find out why and fix stats.py."
WORKSPACE = {
    "stats.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
    "test_stats.py": "from stats import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n",
}
GOOD_FIX = "return sum(xs) / len(xs)"
# The two candidate fixes the branches try, the right one first.
FIXES = (f"    {GOOD_FIX}", "    return sum(xs) / (len(xs) + 1)")
TOOLS = [
    {"type": "function", "function": {"name": "list_files", "description": "List the workspace files",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read one file",
                                      "parameters": {"type": "object",
                                                     "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests with a patch",
                                      "parameters": {"type": "object",
                                                     "properties": {"fix": {"type": "string"}}}}},
]


def arguments_of(call: Any) -> dict[str, Any]:
    """A parsed call's arguments as a dict; a model's malformed JSON becomes ``{}``."""
    try:
        value = json.loads(call.function.arguments or "{}")
    except (json.JSONDecodeError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def tool_result(call: Any) -> str:
    """The workspace's answer to one tool call (an SDK ``ToolCall``); a bad call gets an error
    string, as a real tool would answer it."""
    name, args = call.function.name, arguments_of(call)
    if name == "list_files":
        return "\n".join(sorted(WORKSPACE))
    if name == "read_file":
        return WORKSPACE.get(str(args.get("path")), f"error: no file {args.get('path')!r}")
    if name == "run_tests":
        if str(args.get("fix", "")).strip() == GOOD_FIX:
            return "1 passed"
        return "FAILED test_mean: mean([1, 2, 3]) != 2"
    return f"error: unknown tool {name!r}"


def call_text(call: Any) -> str:
    """A call as one short line, ``name({"arg": ...})``, for the report."""
    return f"{call.function.name}({json.dumps(arguments_of(call))})"
