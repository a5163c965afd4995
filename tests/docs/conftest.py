"""Fixtures for the docs tests: a real ``phloem serve`` for the documented commands to talk to.

``docs_server``: ``python3 -m phloem.cli serve`` on a free loopback port, serving the
built-in tiny model (random weights) from a temporary data dir, started once per test session.
``run_script`` (a fixture returning a function) runs a command the docs show, in the repository
root, and fails the test with its output when it exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from live_servers import ServerProcess

from phloem.runtime import ensure_default_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("phloem-docs-server")
    ensure_default_model(data_dir)
    server = ServerProcess(data_dir).start()
    try:
        yield server
    finally:
        server.stop()


def _run(command: Sequence[str], timeout_s: float = 300.0,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # `python3` in a documented command must be this interpreter (the one with phloem installed).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    full_env = {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    done = subprocess.run(list(command), cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {done.returncode}\n--- stdout\n"
                    f"{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}")
    return done


@pytest.fixture
def run_script() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_script(command, timeout_s=300, env=None)``: run in the repository root, fail on a
    non-zero exit (with the command's output), return the completed process."""
    return _run
