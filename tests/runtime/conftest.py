"""Fixtures of the ``phloem`` command tests."""

from __future__ import annotations

import socket
import sys
import types
from pathlib import Path

import pytest

from phloem.cli.config import ServerConfig


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[ServerConfig]:
    """Stands in for the composition root ``phloem.cli.compose`` (the engine, sessions and app it
    builds are tested elsewhere): records the config ``serve`` gets (and closes the socket ``phloem serve`` bound for it).

    ``$PHLOEM_API_KEY`` / ``$PHLOEM_API_KEYS_FILE`` of the machine running the tests are cleared,
    so they never leak into a test's config; the kernel-cache variables ``phloem serve`` sets are
    restored afterwards.
    """
    configs: list[ServerConfig] = []

    def serve(config: ServerConfig, sock: socket.socket | None = None, **_: object) -> None:
        configs.append(config)
        if sock is not None:
            sock.close()

    compose = types.ModuleType("phloem.cli.compose")
    compose.serve = serve  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "phloem.cli.compose", compose)
    monkeypatch.delenv("PHLOEM_API_KEY", raising=False)
    monkeypatch.delenv("PHLOEM_API_KEYS_FILE", raising=False)
    for name in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        monkeypatch.setenv(name, str(tmp_path / "kernel-cache" / name.lower()))
    return configs


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A folder that passes ``phloem``'s model check (a ``config.json``; nothing loads it here)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder
