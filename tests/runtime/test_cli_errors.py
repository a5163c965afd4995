"""A mistake on the ``phloem`` command line gets a one-line answer, exit status 2, fast: the real
console script, as a subprocess, before any model loads (no traceback, under 3 s)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

FAST_S = 3.0


def phloem(*argv: str, env: dict[str, str] | None = None) -> tuple[int, list[str], float]:
    """Run the ``phloem`` console script; its exit status, stderr lines and wall time."""
    script = shutil.which("phloem")
    if script is None:
        pytest.skip("the `phloem` console script is not installed (pip install -e .)")
    t0 = time.monotonic()
    done = subprocess.run([script, *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    return done.returncode, done.stderr.splitlines(), time.monotonic() - t0


def one_line(lines: list[str], prefix: str, *words: str) -> None:
    assert len(lines) == 1, lines
    assert lines[0].startswith(prefix) and all(w in lines[0] for w in words), lines[0]


def no_gpu() -> None:
    if any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine has an NVIDIA GPU")


@pytest.mark.parametrize("argv", [["serve", "--device", "cuda"], ["bench", "decode", "--device", "cuda"],
                                  ["bench", "long-context", "--device", "cuda:0"]],
                         ids=["serve", "bench-decode", "bench-long-context"])
def test_cuda_on_a_machine_without_it(argv: list[str]) -> None:
    no_gpu()
    code, lines, elapsed = phloem(*argv)
    prog = "phloem " + " ".join(argv[:-2])
    one_line(lines, f"{prog}: error: CUDA is not available on this machine", "use --device cpu")
    assert code == 2 and elapsed < FAST_S


def test_a_missing_model_folder_is_a_usage_error(tmp_path: Path) -> None:
    code, lines, elapsed = phloem("serve", "--model", str(tmp_path / "nope"), "--data-dir", str(tmp_path))
    assert code == 2 and elapsed < FAST_S
    assert lines[0] == "usage: phloem serve [options]"
    one_line(lines[1:], "phloem serve: error: --model: no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, lines, _ = phloem("bench", "prefix-cache", "--model", str(empty))
    assert code == 2 and lines[0] == "usage: phloem bench prefix-cache [options]"
    one_line(lines[1:], "phloem bench prefix-cache: error: --model:", "has no config.json")


def test_a_bad_environment_variable() -> None:
    code, lines, elapsed = phloem("serve", env={"PHLOEM_PORT": "abc"})
    one_line(lines, "phloem: error: PHLOEM_PORT: expected an integer port, got 'abc'")
    assert code == 2 and elapsed < FAST_S


def test_a_bad_value_prints_the_subcommand_usage() -> None:
    code, lines, elapsed = phloem("serve", "--port", "70000")
    assert code == 2 and elapsed < FAST_S
    assert lines == ["usage: phloem serve [options]",
                     "phloem serve: error: port: expected an integer in [0, 65535], got 70000"]


def test_a_port_in_use_is_found_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines, elapsed = phloem("serve", "--port", str(port), "--data-dir", str(tmp_path))
    one_line(lines, f"phloem serve: error: port {port} on 127.0.0.1 is already in use", "--port")
    assert code == 2 and elapsed < FAST_S
    assert not (tmp_path / "models").exists(), "nothing was built before the check"


@pytest.mark.parametrize(("argv", "package"), [(["bench", "agentic"], "matplotlib"), (["bench", "trie"], "trie")],
                         ids=["agentic-plots", "trie-harness"])
def test_a_benchmark_without_the_bench_extra(tmp_path: Path, argv: list[str], package: str) -> None:
    # `pip install phloem` leaves the bench extra out: hide its package from the console script.
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    code, lines, elapsed = phloem(*argv, "--out", str(tmp_path / "out"), env={"PYTHONPATH": path})
    one_line(lines, f"phloem {' '.join(argv)}: error:", package, "pip install 'phloem[bench]'")
    assert code == 2 and elapsed < FAST_S
    assert not (tmp_path / "out").exists()


def test_a_device_out_of_memory_at_start_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 weights of the 35B-A3B shape on an 80 GB card leave the pools' remainder too small for
    the prefill graphs: torch's out-of-memory error (raised here in place of the device's, which
    this machine has none of) becomes one line naming the flags that make room, not a traceback."""
    import torch

    import phloem.cli.compose as compose
    from phloem.cli.main import main

    def out_of_memory(config: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 148.00 MiB. GPU 0 has a total "
                                     "capacity of 79.18 GiB of which 92.19 MiB is free.")

    monkeypatch.setattr(compose, "build_engine", out_of_memory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["serve", "--data-dir", str(tmp_path), "--port", str(port), "--gpu-memory-utilization", "0.85"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("phloem serve: error: out of GPU memory starting the engine (CUDA out of memory; "
                           "Tried to allocate 148.00 MiB)"), last
    assert all(flag in last for flag in ("--gpu-memory-utilization 0.85", "--num-pages", "--quantization fp8"))
