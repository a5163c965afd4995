"""Progress bars: drawn on a terminal only, never with ``--no-progress`` / ``PHLOEM_NO_PROGRESS``,
for building the demo model, loading weights and the benchmarks."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from phloem.engine import CacheConfig, Engine, EngineConfig, LoadConfig
from phloem.runtime import ensure_default_model
from phloem.benchmarks.cli import show_progress
from phloem.cli.main import build_parser
from phloem.runtime.env import read_env
from phloem.runtime.progress import progress, progress_bar, progress_shown


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """Yields ``drawn()``: its first call makes ``sys.stderr`` a pseudo-terminal (in the test
    body: pytest's capture sets ``sys.stderr`` back after fixtures), each call returns what
    was drawn on it so far."""
    master, slave = pty.openpty()
    # A terminal has a size; tqdm sizes a bar on stderr from it (0 x 0 draws nothing).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return  # the slave side closed
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    tty = os.fdopen(slave, "w", buffering=1)

    def drawn() -> str:
        monkeypatch.setattr(sys, "stderr", tty)
        tty.flush()
        # The reader thread drains the terminal: wait until it has been quiet for 0.2 s.
        seen, deadline = -1, time.monotonic() + 5
        while len(chunks) != seen and time.monotonic() < deadline:
            seen = len(chunks)
            time.sleep(0.2)
        return b"".join(chunks).decode(errors="replace")

    try:
        yield drawn
    finally:
        tty.close()
        reader.join(timeout=5)
        os.close(master)


def test_no_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert not progress_shown(None) and not progress_shown(True)
    assert list(progress(range(3), 3, "counting")) == [0, 1, 2]
    with progress_bar(3, "counting") as advance:
        advance(3)
    assert capsys.readouterr().err == ""


def test_a_bar_on_a_terminal_unless_disabled(terminal: Callable[[], str]) -> None:
    assert terminal() == ""
    assert progress_shown(None) and not progress_shown(False)
    assert list(progress(range(4), 4, "quiet", enabled=False)) == [0, 1, 2, 3]
    assert list(progress(range(4), 4, "counting", "step")) == [0, 1, 2, 3]
    text = terminal()
    assert "counting" in text and "0/4" in text and "quiet" not in text


@pytest.mark.slow  # builds and loads the demo model
def test_demo_model_build_and_weight_loading_draw_bars(terminal: Callable[[], str], tmp_path: Path) -> None:
    assert terminal() == ""
    folder = ensure_default_model(tmp_path / "quiet", show_progress=False)
    small = CacheConfig(num_pages=64, num_state_slots=8)
    Engine.from_pretrained(folder, EngineConfig(load=LoadConfig(show_progress=False), cache=small))
    assert terminal() == ""
    folder = ensure_default_model(tmp_path / "loud")
    Engine.from_pretrained(folder, cache=small)
    text = terminal()
    assert "building the demo model" in text and "loading weights" in text


def test_the_flag_and_the_environment_turn_bars_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_env({"PHLOEM_NO_PROGRESS": "1"}).no_progress
    assert not read_env({"PHLOEM_NO_PROGRESS": "0"}).no_progress and not read_env({}).no_progress
    with pytest.raises(ValueError, match="PHLOEM_NO_PROGRESS: expected"):
        read_env({"PHLOEM_NO_PROGRESS": "maybe"})
    parser = build_parser(read_env({}))
    assert show_progress(parser.parse_args(["bench", "prefix-cache", "--no-progress"])) is False
    assert show_progress(parser.parse_args(["bench", "prefix-cache"])) is None
    monkeypatch.setenv("PHLOEM_NO_PROGRESS", "yes")
    assert show_progress(parser.parse_args(["bench", "agentic"])) is False
    args = build_parser().parse_args(["serve"])
    assert args.no_progress is True
