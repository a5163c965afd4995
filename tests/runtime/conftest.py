"""Fixtures of the ``phloem`` command tests."""

from __future__ import annotations

import sys
import types

import pytest

from phloem.runtime import ServerConfig


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ServerConfig]:
    """Stands in for ``phloem.api.app`` (built elsewhere): records the config ``serve`` gets.

    ``$PHLOEM_API_KEY`` / ``$PHLOEM_API_KEYS_FILE`` of the machine running the tests are cleared,
    so they never leak into a test's config.
    """
    configs: list[ServerConfig] = []
    app = types.ModuleType("phloem.api.app")
    app.serve = configs.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "phloem.api.app", app)
    monkeypatch.delenv("PHLOEM_API_KEY", raising=False)
    monkeypatch.delenv("PHLOEM_API_KEYS_FILE", raising=False)
    return configs
