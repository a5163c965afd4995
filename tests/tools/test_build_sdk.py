"""tools/build_sdk.py ships the SDK's import closure, the product's own files, and nothing heavier.

The wheel itself is built and installed in a fresh venv by tools/check_installs.sh (CI); these
tests check what goes into it, without pip.
"""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "build_sdk.py"


def _tool():
    spec = importlib.util.spec_from_file_location("build_sdk", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sdk_ships_its_import_closure_and_no_server_module() -> None:
    modules = _tool().sdk_modules()
    assert {"phloem", "phloem.api", "phloem.api.schemas", "phloem.api._wire_agents", "phloem.api.client",
            "phloem.api.sdk", "phloem.api.sdk._transport", "phloem.api.sdk._sync",
            "phloem.api.sdk._async", "phloem.api.sdk._errors"} <= set(modules)
    assert all(m == "phloem" or m.startswith("phloem.api") for m in modules)
    assert not any(m.startswith("phloem.api.server") for m in modules)


def test_the_staged_project_is_the_products_files_and_pins(tmp_path: Path) -> None:
    tool = _tool()
    files = tool.stage(tmp_path)
    for staged in files:
        source = ROOT / staged.relative_to(tmp_path / "phloem")
        assert staged.read_bytes() == source.read_bytes()
    project = tomllib.loads((tmp_path / "pyproject.toml").read_text())["project"]
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "phloem-sdk"
    assert project["version"] == tool.version()
    assert sorted(project["dependencies"]) == sorted(
        r for r in product["dependencies"] if r.split(">")[0].split("<")[0].split("=")[0] in tool.THIRD_PARTY)
    assert len(project["dependencies"]) == 3


@pytest.mark.parametrize(("source", "message"), [
    ("import torch\n", "imports torch"),
    ("from phloem.engine import Engine\n", "phloem.engine"),
    ("from phloem.api.server.app import create_app\n", "phloem.api.server"),
])
def test_an_import_outside_the_sdk_fails_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   source: str, message: str) -> None:
    tool = _tool()
    for name, text in {"__init__.py": "", "api/__init__.py": "from phloem.api.sdk import Client\n",
                       "api/client.py": "", "api/sdk/__init__.py": "import httpx\nimport json\n"
                       "from phloem.api.sdk._sync import Client\n", "api/sdk/_sync.py": source}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    with pytest.raises(tool.BuildError, match=message):
        tool.sdk_modules()
