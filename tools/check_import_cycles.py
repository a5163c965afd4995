"""Fail when the product's modules import each other in a cycle.

import-linter's contracts keep the layers (cli -> benchmarks -> api -> ... -> kernels) and
the sub-package boundaries; a cycle *inside* a layer passes them. This tool parses every product
module (not the tests), resolves each ``import``/``from … import`` that names a ``phloem`` module
— module level and inside functions alike, since both make the modules depend on each other —
and reports every strongly connected component of more than one module. Imports under
``if TYPE_CHECKING:`` are left out: they never run, and are the standard way to name a type
without depending on its module.

``--count-type-imports PACKAGE`` (repeatable) counts those ``if TYPE_CHECKING:`` imports too, for
the modules inside PACKAGE (a dotted name such as ``phloem.sessions``): a package held to be
acyclic even for type checkers, whose modules name each other's types only downwards. The
cycles reported for it are those among its own modules with every import counted.

Usage: ``python3 tools/check_import_cycles.py [--count-type-imports PACKAGE]... [ROOT]`` (ROOT
defaults to the repository root). Exit 0 when acyclic, 1 with one line per cycle otherwise.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "phloem"
NOT_PRODUCT = {"tests", "tools", "docs", "docker", "build"}


def module_files(root: Path) -> dict[str, Path]:
    """Every product module of the package rooted at ``root``, by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in NOT_PRODUCT or any(part.startswith(".") for part in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((PACKAGE, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST, type_imports: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that execute: everything except the bodies of ``if TYPE_CHECKING:``
    (those too with ``type_imports``)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not type_imports and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies inside."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path],
               type_imports: bool = False) -> set[str]:
    """The product modules ``module`` imports when it runs (a package's ``__init__`` included);
    with ``type_imports``, also those it imports only for type checkers."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text(), str(path)), type_imports):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # ``from pkg import name`` imports pkg.name when that is a module, else pkg.
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name.split(".")[0] != PACKAGE:
                continue
            target = _resolve(name, modules)
            if target and target != module:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def type_import_cycles(package: str, modules: dict[str, Path]) -> list[list[str]]:
    """Cycles among ``package``'s own modules, ``if TYPE_CHECKING:`` imports counted."""
    inner = {name: path for name, path in modules.items() if _inside(name, package)}
    graph = {name: {m for m in imports_of(name, path, modules, type_imports=True) if m in inner}
             for name, path in inner.items()}
    return cycles(graph)


def main(argv: list[str]) -> int:
    args, typed = argv[1:], []
    positional: list[str] = []
    while args:
        if args[0] == "--count-type-imports":
            if len(args) < 2:
                print("--count-type-imports needs a package name", file=sys.stderr)
                return 2
            typed.append(args[1])
            args = args[2:]
        else:
            positional.append(args.pop(0))
    if len(positional) > 1:
        print("at most one ROOT", file=sys.stderr)
        return 2
    root = Path(positional[0]) if positional else Path(__file__).resolve().parents[1]
    modules = module_files(root)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = cycles(graph)
    for component in found:
        print("import cycle: " + " <-> ".join(component))
    print(f"{len(modules)} modules, {len(found)} import cycles")
    for package in typed:
        if not any(_inside(name, package) for name in modules):
            print(f"--count-type-imports: no module {package}", file=sys.stderr)
            return 2
        typed_found = type_import_cycles(package, modules)
        for component in typed_found:
            print("import cycle (type imports counted): " + " <-> ".join(component))
        print(f"{package}: {len(typed_found)} import cycles counting type-only imports")
        found += typed_found
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
