"""A coding agent on Phloem sessions: tool calls in one session, then a fork into parallel branches.

    phloem serve                                         # in another terminal
    python3 docs/examples/agent.py --url http://127.0.0.1:8000

The story: the agent is asked to fix a failing test. It looks at the workspace with tool calls
(``list_files``, ``read_file``), each call's result appended to the same session, so every turn
reuses the cached prefix (``cached`` in the report). Then it forks the session into one branch
per candidate fix and explores them in parallel (``AsyncClient``): each branch proposes its fix
and calls ``run_tests``, which really runs the test against the patched code; each branch
streams its verdict over the WebSocket, and the first branch whose tests pass wins.

The server parses the model's tool calls out of each reply (``result.tool_calls``: typed
``ToolCall`` objects with an id, a name and JSON arguments), so the agent never reads the
model's tool-call markup itself. The calls come from the model's replies (``tool_choice:
auto``): the built-in model of ``phloem serve`` (``docs/default-model.md``) was trained on this
very task and writes ``list_files`` and ``read_file`` calls of its own, often with arguments of
its own too (a call takes 26-44 of its tokens: keep ``--max-tokens`` at 64 or more). When a
reply holds no call (a model that never calls tools, or a call cut short by ``--max-tokens``),
the agent takes the next call from its script, marked ``scripted`` in the report, so the story
always reaches the fork. A branch wins when a ``run_tests`` call it made passes; the fix tested
is the one in the call, which a model may have rewritten.

Nothing is started: ``--url`` names a running server. Only the SDK (``phloem.api``) is
used; ``--json FILE`` also writes the report as JSON, and ``--keep`` keeps the sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from phloem.api import AppendResult, AsyncClient, AsyncSession, Client

SYSTEM = "You are a careful coding agent. Use the tools, read their results, then answer."
TASK = "The test in test_stats.py fails. Find out why and fix stats.py."
WORKSPACE = {
    "stats.py": "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
    "test_stats.py": "from stats import mean\n\n\ndef test_mean():\n    assert mean([1, 2, 3]) == 2\n",
}
BUGGY_LINE = "    return sum(xs) / (len(xs) - 1)"
FIXES = ("    return sum(xs) / len(xs)", "    return sum(xs) / (len(xs) + 1)")
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
# What the agent does when the model proposes no call.
SCRIPT = [{"name": "list_files", "arguments": {}},
          {"name": "read_file", "arguments": {"path": "stats.py"}}]


@dataclass
class Step:
    """One generation of the agent and the tool calls it led to."""

    session_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    num_tokens: int
    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Calls the model wrote in a reply the story ends on (before the fork, a branch's last): not run.
    unanswered: list[dict[str, Any]] = field(default_factory=list)


def parse_tool_calls(result: AppendResult) -> list[dict[str, Any]]:
    """The calls the server parsed out of the reply; arguments that are not a JSON object (a
    model's mistake) become an empty object."""
    calls = []
    for call in result.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = {}
        calls.append({"id": call.id, "name": call.function.name,
                      "arguments": arguments if isinstance(arguments, dict) else {}})
    return calls


def run_tests(fix: str) -> str:
    """Really run ``test_mean`` against ``stats.py`` with its buggy line replaced by ``fix``."""
    namespace: dict[str, Any] = {}
    try:
        # The fix is a model's line when the model wrote the call: it may not even run.
        exec(WORKSPACE["stats.py"].replace(BUGGY_LINE, fix), namespace)
        value = namespace["mean"]([1, 2, 3])
    except Exception as exc:
        return f"FAILED test_mean: {type(exc).__name__}: {exc}"
    if value != 2:
        return f"FAILED test_mean: mean([1, 2, 3]) == {value}, expected 2"
    return "1 passed"


def run_tool(call: dict[str, Any]) -> str:
    """Execute one tool call; a bad call gets an error string, as the model would see it."""
    name, args = call["name"], call.get("arguments") or {}
    if name == "list_files":
        return "\n".join(sorted(WORKSPACE))
    if name == "read_file":
        return WORKSPACE.get(str(args.get("path")), f"error: no file {args.get('path')!r}")
    if name == "run_tests":
        return run_tests(str(args.get("fix", "")))
    return f"error: unknown tool {name!r}"


def next_calls(result: AppendResult, fallback: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's tool calls, or the scripted one (marked) when it proposed none."""
    calls = parse_tool_calls(result)
    return [{**c, "scripted": False} for c in calls] or [{**fallback, "scripted": True}]


def tool_messages(calls: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c.get("id") or f"call_{turn}_{i}", "content": run_tool(c)}
            for i, c in enumerate(calls)]


def step(session_id: str, result: AppendResult, calls: list[dict[str, Any]]) -> Step:
    """The report's row for ``result``; ``calls`` are the ones run (none: the story ends here)."""
    u = result.usage
    return Step(session_id, result.turn, u.prompt_tokens, u.cached_tokens, u.completion_tokens,
                result.num_tokens, result.text, calls, [] if calls else parse_tool_calls(result))


async def explore(session: AsyncSession, fix: str, generate: dict[str, Any]) -> dict[str, Any]:
    """One branch: propose ``fix``, run the tests (a tool call), stream the verdict."""
    first = await session.append(
        messages=[{"role": "user", "content": f"Try this fix:\n{fix}\nThen run the tests."}],
        generate=generate)
    calls = next_calls(first, {"name": "run_tests", "arguments": {"fix": fix}})
    results = tool_messages(calls, first.turn)
    # The verdict is the last run_tests call's: a model may have called another tool instead.
    tested = [(c, r["content"]) for c, r in zip(calls, results) if c["name"] == "run_tests"]
    verdict = tested[-1][1] if tested else "not run (no run_tests call)"
    deltas = []
    async with session.stream(messages=results, generate=generate, transport="websocket") as stream:
        async for delta in stream:
            deltas.append(delta.text)
    assert stream.result is not None
    return {"session_id": session.id, "fix": fix.strip(), "tests": verdict,
            "tested_fix": str(tested[-1][0]["arguments"].get("fix", "")).strip() if tested else None,
            "passed": verdict == "1 passed", "streamed_text": "".join(deltas),
            "steps": [asdict(step(session.id, first, calls)),
                      asdict(step(session.id, stream.result, []))]}


async def explore_all(url: str, api_key: str | None, branch_ids: list[str],
                      generate: dict[str, Any]) -> list[dict[str, Any]]:
    async with AsyncClient(url, api_key=api_key) as client:
        branches = [await client.sessions.get(i) for i in branch_ids]
        return list(await asyncio.gather(*(
            explore(b, fix, {**generate, "temperature": 0.8, "seed": k})
            for k, (b, fix) in enumerate(zip(branches, FIXES)))))


def run_agent(url: str, api_key: str | None, max_tokens: int, keep: bool) -> dict[str, Any]:
    """The whole story; returns the report (see the module docstring)."""
    generate = {"max_tokens": max_tokens, "temperature": 0.0}
    with Client(url, api_key=api_key) as client:
        root = client.sessions.create(messages=[{"role": "system", "content": SYSTEM}],
                                      tools=TOOLS, metadata={"example": "agent"})
        created = [root.id]
        try:
            steps: list[Step] = []
            result = root.append(messages=[{"role": "user", "content": TASK}], generate=generate)
            for scripted in SCRIPT:
                calls = next_calls(result, scripted)
                steps.append(step(root.id, result, calls))
                result = root.append(messages=tool_messages(calls, result.turn), generate=generate)
            steps.append(step(root.id, result, []))
            fork_turn = result.turn
            branches = root.fork(len(FIXES))
            created += [b.id for b in branches]
            explored = asyncio.run(explore_all(url, api_key, [b.id for b in branches], generate))
        finally:
            if not keep:
                for session_id in reversed(created):
                    client.sessions.delete(session_id)
    return {"url": url, "root": root.id, "steps": [asdict(s) for s in steps],
            "fork": {"at_turn": fork_turn, "num_tokens": result.num_tokens, "branches": explored},
            "winner": next((b["session_id"] for b in explored if b["passed"]), None),
            "kept": keep}


def print_report(report: dict[str, Any]) -> None:
    def row(s: dict[str, Any], label: str) -> None:
        calls = ", ".join(f"{c['name']}({json.dumps(c['arguments'])})"
                          + (" [scripted]" if c["scripted"] else "") for c in s["tool_calls"])
        calls = calls or ", ".join(f"{c['name']}({json.dumps(c['arguments'])}) [not run]"
                                   for c in s["unanswered"])
        print(f"{label:<10} turn {s['turn']:<2} prompt {s['prompt_tokens']:>5}  cached "
              f"{s['cached_tokens']:>5}  completion {s['completion_tokens']:>3}  "
              f"{('→ ' + calls) if calls else repr(s['text'][:40])}")
    print(f"session {report['root']}")
    for s in report["steps"]:
        row(s, "root")
    fork = report["fork"]
    print(f"fork: {len(fork['branches'])} branches after turn {fork['at_turn']} "
          f"({fork['num_tokens']} shared tokens)")
    for k, b in enumerate(fork["branches"]):
        for s in b["steps"]:
            row(s, f"branch {'ABCDEFGH'[k]}")
        tried = "" if b["tested_fix"] in (None, b["fix"]) else f", the model tested {b['tested_fix']!r}"
        print(f"           proposed {b['fix']!r}{tried}: {b['tests'].splitlines()[0]}")
    print(f"winner: {report['winner']}" + ("" if report["kept"] else " (sessions deleted)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python3 docs/examples/agent.py --url http://127.0.0.1:8000\n"
               "  python3 docs/examples/agent.py --url http://gpu-box:8000 --max-tokens 256 --json report.json")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("PHLOEM_API_KEY"),
                        help="API key (default: $PHLOEM_API_KEY)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the sessions (default: delete them)")
    args = parser.parse_args(argv)
    report = run_agent(args.url, args.api_key, args.max_tokens, args.keep)
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
