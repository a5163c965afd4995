"""The SDK example of ``docs/api.md`` ("The Python SDK") runs against a real server, quickly:
every generation in it is bounded by ``max_tokens`` (a stream without one runs to the end of
the context window, about a minute on a CPU)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from live_servers import ServerProcess
import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"
URL = "http://127.0.0.1:8000"


def sdk_example() -> str:
    section = PAGE.read_text(encoding="utf-8").split("## The Python SDK", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_every_generation_of_the_example_is_bounded() -> None:
    calls = re.findall(r"\.(?:append|stream)\((.*?)\)(?: as|\n)", sdk_example(), re.S)
    assert calls and all("max_tokens" in call for call in calls), calls


@pytest.mark.slow  # the docs' phloem serve process
def test_the_sdk_example_runs(docs_server: ServerProcess, run_script: Any, tmp_path: Path) -> None:
    script = tmp_path / "api_sdk_example.py"
    script.write_text(sdk_example().replace(URL, docs_server.base_url), encoding="utf-8")
    run_script([sys.executable, str(script)], timeout_s=60)
