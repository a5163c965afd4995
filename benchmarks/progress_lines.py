"""Plain progress lines on stderr for a benchmark run whose stderr is not a terminal.

Progress bars (``runtime.progress``) are drawn only on a terminal, so a benchmark piped into a
file or a CI log printed nothing for minutes. Under ``progress_lines(name)`` a piped run gets
``<name>: <what>`` lines instead: one when each phase starts (``phase``), and, while a phase
runs, its latest state (``tick``: "point 2/4 (batch 4, context 256): 12/20 steps") every
``interval_s`` seconds from a daemon thread, so a silent stretch never lasts longer than that,
whatever the engine is doing. On a terminal (the bars speak there) and with ``--no-progress`` it
prints nothing. The functions here are no-ops outside ``progress_lines``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["phase", "progress_lines", "tick"]

_active: _Lines | None = None


class _Lines:
    def __init__(self, name: str, stream: TextIO, interval_s: float) -> None:
        self.name, self.stream, self.interval_s = name, stream, interval_s
        self.lock = threading.Lock()
        self.phase = ""
        self.detail = ""
        self.phase_started = self.last_line = time.monotonic()
        self.stopped = threading.Event()

    def write(self, text: str) -> None:
        with self.lock:
            self.stream.write(f"{self.name}: {text}\n")
            self.stream.flush()
            self.last_line = time.monotonic()

    def status(self) -> str:
        elapsed = time.monotonic() - self.phase_started
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.phase}{detail} ({elapsed:.0f} s)"

    def heartbeat(self) -> None:
        while not self.stopped.wait(min(0.5, self.interval_s / 2)):
            if time.monotonic() - self.last_line >= self.interval_s:
                self.write(self.status())


@contextlib.contextmanager
def progress_lines(name: str, enabled: bool | None = None, stream: TextIO | None = None,
                   interval_s: float = 2.0) -> Iterator[None]:
    """Print ``name: ...`` progress lines while the block runs, when ``stream`` (stderr) is not a
    terminal and ``enabled`` is not False.

    Args:
        name: The run's name, e.g. ``bench decode``.
        enabled: False: never (``--no-progress``); None or True: when the stream is no terminal.
        stream: Where the lines go (default: ``sys.stderr``).
        interval_s: Longest silence while a phase runs.
    """
    global _active
    out = sys.stderr if stream is None else stream
    isatty = getattr(out, "isatty", None)
    if enabled is False or (isatty is not None and isatty()) or _active is not None:
        yield
        return
    lines = _Lines(name, out, interval_s)
    thread = threading.Thread(target=lines.heartbeat, name="progress-lines", daemon=True)
    _active = lines
    thread.start()
    try:
        yield
    finally:
        lines.stopped.set()
        thread.join()
        _active = None


def phase(text: str) -> None:
    """A new phase begins: print it now (and its state every ``interval_s`` while it runs)."""
    lines = _active
    if lines is None:
        return
    with lines.lock:
        lines.phase, lines.detail, lines.phase_started = text, "", time.monotonic()
    lines.write(text)


def tick(detail: str) -> None:
    """The running phase's latest state, printed by the next heartbeat line (not at once)."""
    lines = _active
    if lines is not None:
        lines.detail = detail
