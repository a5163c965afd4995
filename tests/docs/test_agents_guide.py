"""The examples of ``docs/agents.md`` (the openai client with chat completions and the Responses
API, the OpenAI Agents SDK, the anthropic client, LangChain, the SDK) run against a real server
with the built-in random-weight model.

Every fenced ``python`` block preceded by ``<!-- run -->`` is run as its own script, with the
documented URL replaced by the test server's; the blocks assert their own claims (calls that
validate, reassembled streams, shared prompt tokens, cache reuse)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from live_servers import ServerProcess

PAGE = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
URL = "http://127.0.0.1:8000"
BLOCKS = re.findall(r"<!-- run -->\n```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def test_the_guide_shows_every_client() -> None:
    assert len(BLOCKS) == 7 and all(URL in block for block in BLOCKS)
    shown = ("import openai", "client.responses.create", "from agents import", "import anthropic",
             "langchain_openai", "from phloem.api import")
    assert [k for k in shown if any(k in b for b in BLOCKS)] == list(shown)


@pytest.mark.slow  # the docs' phloem serve process
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_agents_guide_example_runs(index: int, docs_server: ServerProcess, run_script: Any, tmp_path: Path) -> None:
    script = tmp_path / f"agents_example_{index}.py"
    script.write_text(BLOCKS[index].replace(URL, docs_server.base_url), encoding="utf-8")
    run_script([sys.executable, str(script)], timeout_s=120)
