"""The examples of ``docs/sdk.md`` run against a real server.

Every fenced ``python`` block preceded by ``<!-- run -->`` is run as its own script, with the
documented URL replaced by the test server's. The blocks check their own claims with ``assert``
(cached tokens, cancellation, fork sharing), so a block that runs but contradicts the guide fails.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from live_servers import ServerProcess

PAGE = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
URL = "http://127.0.0.1:8000"
BLOCKS = re.findall(r"<!-- run -->\n```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def test_the_guide_has_runnable_examples() -> None:
    assert len(BLOCKS) >= 6
    assert all(URL in block for block in BLOCKS)


@pytest.mark.slow  # the docs' phloem serve process
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_sdk_guide_example_runs(index: int, docs_server: ServerProcess, run_script: Any,
                                tmp_path: Path) -> None:
    script = tmp_path / f"sdk_example_{index}.py"
    script.write_text(BLOCKS[index].replace(URL, docs_server.base_url), encoding="utf-8")
    run_script([sys.executable, str(script)], timeout_s=120)
