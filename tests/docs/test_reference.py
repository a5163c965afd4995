"""The generated docs are up to date: regenerating them from the code changes nothing.

``docs/reference/generate.py --out DIR`` writes ``api.md``, ``openapi.json`` and
``configuration.md`` into a temporary folder; each must equal the committed file byte for byte.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # generate.py in a process; the docs' phloem serve process

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "python3 docs/reference/generate.py"
COMMITTED = {
    "api.md": REPO / "docs" / "reference" / "api.md",
    "openapi.json": REPO / "docs" / "reference" / "openapi.json",
    "configuration.md": REPO / "docs" / "configuration.md",
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs-generated")
    # The developer's PHLOEM_* variables must not change the output (generate.py ignores them).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHLOEM_")}
    env["PHLOEM_HOST"] = "203.0.113.7"  # proof: a set variable does not leak into the page
    done = subprocess.run([sys.executable, "docs/reference/generate.py", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{REGENERATE} failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_committed_docs_match_the_code(generated: Path, name: str) -> None:
    committed = COMMITTED[name].read_text(encoding="utf-8")
    fresh = (generated / name).read_text(encoding="utf-8")
    if committed != fresh:
        diff = "".join(list(difflib.unified_diff(
            committed.splitlines(keepends=True), fresh.splitlines(keepends=True),
            f"committed {COMMITTED[name].relative_to(REPO)}", "generated from the code"))[:80])
        pytest.fail(f"{COMMITTED[name].relative_to(REPO)} is out of date; run `{REGENERATE}` "
                    f"and commit the result. First differences:\n{diff}")


def test_openapi_json_is_what_the_server_serves(docs_server: Any) -> None:
    """The committed document is the live server's ``/schema/openapi.json``, minus the random
    ``examples`` Litestar adds (generate.py, "Decision")."""
    import httpx

    sys.path.insert(0, str(REPO / "docs" / "reference"))
    try:
        from generate import _strip_examples
    finally:
        sys.path.pop(0)
    served = httpx.get(f"{docs_server.base_url}/schema/openapi.json", timeout=30).json()
    committed = json.loads(COMMITTED["openapi.json"].read_text(encoding="utf-8"))
    assert _strip_examples(served) == committed, f"run `{REGENERATE}`"
