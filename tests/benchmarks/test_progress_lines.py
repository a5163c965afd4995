"""Benchmarks speak without a terminal: ``benchmarks.progress_lines`` and ``phloem bench decode``
through a pipe."""

from __future__ import annotations

import io
import os
import selectors
import subprocess
import sys
import time

import pytest

from phloem.benchmarks.progress_lines import phase, progress_lines, tick


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_name_each_phase_and_repeat_its_state_while_it_runs() -> None:
    out = io.StringIO()
    with progress_lines("bench x", stream=out, interval_s=0.05):
        phase("loading")
        tick("3/8 steps")
        time.sleep(0.3)
        phase("done")
    lines = out.getvalue().splitlines()
    assert lines[0] == "bench x: loading" and lines[-1] == "bench x: done"
    assert any(line.startswith("bench x: loading: 3/8 steps (") for line in lines[1:-1]), lines


@pytest.mark.parametrize(("stream", "enabled"), [(_Terminal(), None), (io.StringIO(), False)],
                         ids=["terminal", "no-progress"])
def test_no_lines_on_a_terminal_or_when_disabled(stream: io.StringIO, enabled: bool | None) -> None:
    with progress_lines("bench x", enabled, stream=stream, interval_s=0.01):
        phase("loading")
        time.sleep(0.05)
    assert stream.getvalue() == ""
    phase("outside")  # a no-op
    tick("outside")


@pytest.mark.slow  # starts `phloem bench decode` (stopped after its first lines)
def test_bench_decode_prints_progress_within_5_s_when_piped() -> None:
    command = [sys.executable, "-m", "phloem.cli", "bench", "decode", "--shape", "tiny", "--device", "cpu",
               "--batches", "1", "--contexts", "256", "--steps", "2", "--prefill-tokens", "0", "--no-served"]
    env = {k: v for k, v in os.environ.items() if k != "PHLOEM_NO_PROGRESS"}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    assert process.stderr is not None
    lines: list[tuple[float, str]] = []
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stderr, selectors.EVENT_READ)
            buffer = b""
            while time.monotonic() - started < 30 and len(lines) < 3:
                if not selector.select(timeout=0.5):
                    continue
                chunk = os.read(process.stderr.fileno(), 4096)
                if not chunk:
                    break
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [(time.monotonic() - started, line.decode()) for line in done]
    finally:
        process.kill()
        process.wait()
        process.stderr.close()
    assert lines, "no progress line within 30 s"
    first_at, first = lines[0]
    assert first.startswith("bench decode: ") and first_at < 5.0, lines
    assert len(lines) >= 2, f"only one line in 30 s: {lines}"
