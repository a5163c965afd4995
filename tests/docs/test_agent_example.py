"""``docs/examples/agent.py`` (the SDK guide's agent) runs end to end against a real server.

The script's own report is checked for the cache arithmetic (every generation after the first
reuses exactly the history it extends), and the server is then asked, through the SDK and
independently of the script, whether the fork branches really share the parent's turns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from live_servers import ServerProcess
import pytest

from phloem.api import Client

pytestmark = pytest.mark.slow  # runs the example against the docs' phloem serve process

AGENT = "docs/examples/agent.py"


def _check_cache(steps: list[dict[str, Any]], start_tokens: int | None) -> None:
    """Each generation's cached prefix is the whole history before its new input."""
    previous = start_tokens
    for s in steps:
        if previous is not None:
            assert s["cached_tokens"] == previous, s
            assert s["prompt_tokens"] > previous, s
        previous = s["num_tokens"]


def test_agent_example_tool_calls_and_forks(docs_server: ServerProcess, run_script: Any,
                                            tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    done = run_script([sys.executable, AGENT, "--url", docs_server.base_url, "--max-tokens", "12",
                       "--json", str(report_path), "--keep"])
    report = json.loads(report_path.read_text())
    steps, fork = report["steps"], report["fork"]

    # Root: task, then one generation per tool round; each round's calls ran and were appended.
    assert [s["turn"] for s in steps] == [1, 2, 3]
    assert [c["name"] for s in steps for c in s["tool_calls"]] == ["list_files", "read_file"]
    assert steps[0]["cached_tokens"] == 0
    _check_cache(steps, None)
    assert "root       turn 2" in done.stdout and "cached" in done.stdout

    # Branches: both start from the parent's whole history (cached), then run their own tools.
    branches = fork["branches"]
    assert len(branches) == 2
    for branch in branches:
        _check_cache(branch["steps"], fork["num_tokens"])
        assert branch["steps"][0]["tool_calls"][0]["name"] == "run_tests"
    assert [b["passed"] for b in branches] == [True, False]  # the real test run decides
    assert report["winner"] == branches[0]["session_id"]

    with Client(docs_server.base_url, timeout=60) as client:
        root = client.sessions.get(report["root"])
        parent_turns = root.turns(include_tokens=True)
        assert len(parent_turns) == fork["at_turn"] + 1
        for branch in branches:
            child = client.sessions.get(branch["session_id"])
            assert (child.info.parent_id, child.info.fork_turn) == (root.id, fork["at_turn"])
            child_turns = child.turns(include_tokens=True)
            shared = child_turns[:len(parent_turns)]
            assert [t.token_ids for t in shared] == [t.token_ids for t in parent_turns]
            # The streamed deltas are exactly the branch's last committed output.
            last = child_turns[-1]
            assert last.index == branch["steps"][-1]["turn"]
            assert branch["streamed_text"] == branch["steps"][-1]["text"]
            child.delete()
        root.delete()


def test_agent_example_calls_tools_of_the_built_in_model_s_own(docs_server: ServerProcess, run_script: Any,
                                                               tmp_path: Path) -> None:
    """With the default ``--max-tokens``, the trained built-in model (the docs server's default)
    writes the root's tool calls itself: nothing is scripted (greedy, so the same every run)."""
    report_path = tmp_path / "report.json"
    done = run_script([sys.executable, AGENT, "--url", docs_server.base_url, "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    calls = [c for s in report["steps"] for c in s["tool_calls"]]
    assert [c["name"] for c in calls] == ["list_files", "read_file"], done.stdout
    assert not any(c["scripted"] for c in calls) and "[scripted]" not in done.stdout.split("fork:")[0]
    assert all(c["id"] for c in calls)  # the server's ids for the calls it parsed
