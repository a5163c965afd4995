"""The test run is hermetic (``tests/conftest.py``): a temporary home and default data directory,
for this process and the ones it spawns, never the user's ``~/.phloem``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from phloem.cli.config import ServerConfig
from phloem.runtime.env import default_data_dir


def test_home_and_data_dir_are_temporary() -> None:
    home = Path(os.environ["HOME"])
    assert home.is_relative_to(tempfile.gettempdir()) and home.name == "home"
    assert default_data_dir() == ServerConfig().data_dir == home / ".phloem"
    assert Path("~/.phloem").expanduser() == default_data_dir()


def test_spawned_processes_inherit_them() -> None:
    code = "from phloem.runtime.env import default_data_dir; import os; print(os.environ['HOME'], default_data_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == [os.environ["HOME"], str(default_data_dir())]
