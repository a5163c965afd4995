"""Lazy package exports: a package's public names load their modules on first access.

A package ``__init__`` lists ``name -> module`` and sets ``__getattr__ = lazy_exports(__name__,
NAMES)``, so importing the package stays cheap (``phloem --help`` and the CLI's configuration
never load torch) while ``from phloem.engine import Engine`` still works. Type checkers see the
names through the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that imports ``names[name]`` on first use.

    Args:
        package: The package's dotted name (its ``__name__``), for the error message.
        names: Exported name -> the module that defines it.

    Returns:
        The ``__getattr__`` (PEP 562); an unknown name raises ``AttributeError`` as Python does.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
