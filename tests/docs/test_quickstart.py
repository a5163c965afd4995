"""``docs/quickstart.md`` works: its commands run against a real server, and its install and test
commands are the README's.

Every fenced ``bash`` block preceded by ``<!-- run -->`` is run, in page order, as one
``set -euo pipefail`` script (shell variables carry from block to block), with the documented
address ``127.0.0.1:8000`` replaced by the test server's. The install, ``phloem serve`` and
test-suite blocks are not run here (CI runs the README's install and test lines itself).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from live_servers import ServerProcess
import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "quickstart.md"
ADDRESS = "127.0.0.1:8000"


def _blocks(text: str, marked: bool) -> list[str]:
    prefix = r"<!-- run -->\n" if marked else ""
    return re.findall(prefix + r"```bash\n(.*?)```", text, re.S)


@pytest.mark.slow  # the docs' phloem serve process
def test_quickstart_commands_run_against_a_real_server(docs_server: ServerProcess,
                                                       run_script: Any) -> None:
    text = PAGE.read_text(encoding="utf-8")
    blocks = _blocks(text, marked=True)
    assert len(blocks) >= 8, "the quickstart lost its runnable blocks"
    assert all(ADDRESS in block for block in blocks)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    port = docs_server.base_url.rsplit(":", 1)[1]
    done = run_script(["bash", "-c", script.replace(ADDRESS, f"127.0.0.1:{port}")])
    out = done.stdout
    assert '{"status":"ok"' in out
    # Only the page's deliberate error example may answer with a problem.
    assert re.findall(r"urn:phloem:error:(\w+)", out) == ["invalid_request"], out
    first, second = (json.loads(line) for line in out.splitlines() if line.startswith('{"turn":'))
    assert second["usage"]["cached_tokens"] == first["num_tokens"] > 0, out
    assert "event: done" in out and '"type":"done"' in out          # SSE
    assert out.count("204\n") == 2                                   # both deletes
    assert " done " in out                                           # raw WebSocket events


def test_quickstart_installs_and_tests_as_the_readme_says() -> None:
    readme_blocks = _blocks((REPO / "README.md").read_text(encoding="utf-8"), marked=False)
    page_blocks = "\n".join(_blocks(PAGE.read_text(encoding="utf-8"), marked=False))
    assert readme_blocks, "README.md has no bash blocks"
    for block in readme_blocks:
        for line in filter(None, (line.strip() for line in block.splitlines())):
            assert line in page_blocks, f"README command missing from quickstart.md: {line}"
    assert "phloem serve\n" in page_blocks
