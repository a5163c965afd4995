"""Build ``phloem-sdk``: the Python SDK alone, a wheel without torch or the server.

    python3 tools/build_sdk.py                 # -> dist/phloem_sdk-<version>-py3-none-any.whl
    python3 tools/build_sdk.py --out DIR
    python3 tools/build_sdk.py --list          # the modules it would ship, nothing built

The wheel holds the ``phloem`` modules that ``phloem.api`` (the SDK's public import path, ``from
phloem.api import Client``) and ``phloem.api.client`` (its former path) import, found by reading
their imports (the closure, not a hand-kept list): today ``phloem/__init__.py``,
``phloem/api/__init__.py``, ``phloem/api/client.py``, the wire schemas (``api/schemas.py``,
``api/_wire_agents.py``) and ``phloem/api/sdk/``. The files are the product's own, unchanged,
so the same import works in both installs. Its dependencies are the product's pins of httpx,
msgspec and websockets (read from pyproject.toml); any other import outside the standard library,
or a module of the server, sessions, runtime, engine, kernels or storage, fails the build.

``phloem-sdk`` is a subset of ``phloem``: the two install the same files under ``phloem/``, so
install one or the other, never both (``pip install phloem`` already has the SDK).

The package directories do not sit under a project folder of their own (the repository root is
the ``phloem`` package), so the wheel is built from a staging folder: the files, copied under
``phloem/``, and a pyproject.toml written here; ``pip wheel --no-deps`` builds it.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "phloem"
# The SDK's public import paths; everything they import comes along.
ENTRY_MODULES = ("phloem.api", "phloem.api.sdk", "phloem.api.client")
# What the SDK may import besides the standard library and its own modules.
THIRD_PARTY = ("httpx", "msgspec", "websockets")
FORBIDDEN = ("phloem.api.server", "phloem.sessions", "phloem.runtime", "phloem.engine",
             "phloem.kernels", "phloem.storage", "phloem.cli", "phloem.benchmarks")


class BuildError(Exception):
    """The SDK's import closure left its allowed set; the message says which import did."""


def _file(module: str) -> Path | None:
    """The source of ``module`` (``phloem.a.b``): a package's ``__init__.py`` or a module file."""
    rel = Path(*module.split(".")[1:])
    for path in (ROOT / rel / "__init__.py", (ROOT / rel).with_suffix(".py")):
        if path.is_file() and (module != PACKAGE or path.name == "__init__.py"):
            return path
    return None


def _imports(module: str, path: Path) -> list[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved), in any block."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.append(base)
            # `from phloem.api.sdk import _transport` imports a module, not only a name.
            found += [f"{base}.{alias.name}" for alias in node.names
                      if base.startswith(PACKAGE) and _file(f"{base}.{alias.name}") is not None]
    return found


def sdk_modules() -> dict[str, Path]:
    """The ``phloem`` modules the SDK's entry points import, transitively, with their files.

    Raises:
        BuildError: A forbidden ``phloem`` module, or a third-party one outside ``THIRD_PARTY``.
    """
    todo = list(ENTRY_MODULES)
    modules: dict[str, Path] = {}
    while todo:
        module = todo.pop()
        if module in modules:
            continue
        if module.startswith(FORBIDDEN) or any(module == f for f in FORBIDDEN):
            raise BuildError(f"the SDK imports {module}, which is not part of the SDK")
        path = _file(module)
        if path is None:
            raise BuildError(f"the SDK imports {module}, which has no source file here")
        modules[module] = path
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += parents
        for name in _imports(module, path):
            top = name.split(".")[0]
            if top == PACKAGE:
                todo.append(name)
            elif top not in sys.stdlib_module_names and top not in THIRD_PARTY and top != "__future__":
                raise BuildError(f"{path.relative_to(ROOT)} imports {name}: the SDK may import only "
                                 f"the standard library and {', '.join(THIRD_PARTY)}")
    return dict(sorted(modules.items()))


def _requirements(project: dict[str, object]) -> list[str]:
    """The product's own requirement strings for the SDK's third-party packages."""
    pins = [r for r in project["dependencies"]  # type: ignore[union-attr]
            if re.split(r"[\s<>=!~;\[]", str(r), maxsplit=1)[0].lower() in THIRD_PARTY]
    missing = set(THIRD_PARTY) - {re.split(r"[\s<>=!~;\[]", p, maxsplit=1)[0].lower() for p in pins}
    if missing:
        raise BuildError(f"pyproject.toml's dependencies lost {', '.join(sorted(missing))}")
    return [str(p) for p in pins]


def _pyproject(version: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    deps = "".join(f'    "{r}",\n' for r in _requirements(project))
    return f"""[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "phloem-sdk"
version = "{version}"
description = "The Python SDK of a Phloem server (no torch): from phloem.api import Client"
readme = "README.md"
requires-python = "{project["requires-python"]}"
license = {{ text = "{project["license"]["text"]}" }}
dependencies = [
{deps}]

[tool.setuptools.packages.find]
include = ["phloem*"]
"""


_README = """# phloem-sdk

The Python SDK of a Phloem server, without the server: `from phloem.api
import Client, AsyncClient`. It needs httpx, websockets and msgspec, never torch. Built from the
Phloem repository by `python3 tools/build_sdk.py`; the full `phloem` package already contains it
(install one or the other). The guide is the repository's docs/sdk.md.
"""


def version() -> str:
    """``phloem.__version__``, read from the source (the SDK's version is the product's)."""
    found = re.search(r'^__version__ = "([^"]+)"', (ROOT / "__init__.py").read_text(), re.M)
    if found is None:
        raise BuildError("__init__.py has no __version__")
    return found.group(1)


def stage(dest: Path) -> list[Path]:
    """Copy the SDK's files under ``dest/phloem/`` and write its pyproject.toml and README."""
    files = []
    for path in sdk_modules().values():
        target = dest / PACKAGE / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        files.append(target)
    (dest / "pyproject.toml").write_text(_pyproject(version()), encoding="utf-8")
    (dest / "README.md").write_text(_README, encoding="utf-8")
    return files


def build(out: Path) -> Path:
    """Build the wheel into ``out``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="phloem-sdk-") as tmp:
        stage(Path(tmp))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), tmp],
                       check=True)
    wheel = out / f"phloem_sdk-{version()}-py3-none-any.whl"
    if not wheel.is_file():
        raise BuildError(f"pip wheel did not write {wheel}")
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the wheel goes (default: dist/)")
    parser.add_argument("--list", action="store_true", help="print the modules it ships and exit")
    args = parser.parse_args(argv)
    try:
        if args.list:
            for module, path in sdk_modules().items():
                print(f"{module}  {path.relative_to(ROOT)}")
            return 0
        print(build(args.out))
    except BuildError as exc:
        sys.stderr.write(f"build_sdk: error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
