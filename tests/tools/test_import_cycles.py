"""tools/check_import_cycles.py finds runtime import cycles and ignores TYPE_CHECKING-only ones."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_import_cycles.py"


def _tool():
    spec = importlib.util.spec_from_file_location("check_import_cycles", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/one.py": "from phloem.a.two import f\n",
        "a/two.py": "def f():\n    from .three import g\n",
        "a/three.py": "import phloem.a.one\n",
        "b.py": "from phloem.a import one\n",
    })
    tool = _tool()
    modules = tool.module_files(root)
    graph = {name: tool.imports_of(name, path, modules) for name, path in modules.items()}
    assert tool.cycles(graph) == [["phloem.a.one", "phloem.a.three", "phloem.a.two"]]
    assert tool.main(["tool", str(root)]) == 1


def test_type_checking_imports_are_not_a_cycle(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "one.py": "from phloem.two import T\n",
        "two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phloem.one import U\nT = 1\n",
    })
    assert _tool().main(["tool", str(root)]) == 0


def test_type_checking_imports_count_inside_the_named_package(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "__init__.py": "",
        "one.py": "from phloem.two import T\n",
        "two.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from phloem.one import U\nT = 1\n",
        "pkg/__init__.py": "",
        "pkg/a.py": "from phloem.pkg.b import T\n",
        "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from phloem.pkg.a import U\nT = 1\n",
    })
    tool = _tool()
    modules = tool.module_files(root)
    assert tool.type_import_cycles("phloem.pkg", modules) == [["phloem.pkg.a", "phloem.pkg.b"]]
    assert tool.main(["tool", str(root)]) == 0
    # Only the named package's cycles count: the one through phloem.one/two stays allowed.
    assert tool.main(["tool", "--count-type-imports", "phloem.pkg", str(root)]) == 1
    (root / "pkg" / "b.py").write_text("T = 1\n")
    assert tool.main(["tool", "--count-type-imports", "phloem.pkg", str(root)]) == 0
    assert tool.main(["tool", "--count-type-imports", "phloem.nowhere", str(root)]) == 2


@pytest.mark.slow  # tools/check_import_cycles.py over the product, in a process
def test_the_product_has_no_import_cycle() -> None:
    result = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


@pytest.mark.slow  # tools/check_import_cycles.py over the product, in a process
def test_sessions_has_no_import_cycle_counting_type_imports() -> None:
    result = subprocess.run([sys.executable, str(TOOL), "--count-type-imports", "phloem.sessions"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout
