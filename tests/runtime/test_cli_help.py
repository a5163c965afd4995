"""Every ``phloem`` command and subcommand documents itself: ``--help`` exits 0 and shows an
``examples:`` section. The parser tree is walked, so a command added later is checked too."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from phloem.cli.main import build_parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(argv prefix, parser)`` for the root and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


ALL = [path for path, _ in commands(build_parser())]


def test_the_tree_has_every_known_command() -> None:
    assert {("serve",), ("demo",), ("bench",), ("bench", "decode"), ("bench", "long-context"),
            ("bench", "prefix-cache"), ("bench", "agentic")} <= set(ALL)


@pytest.mark.parametrize("path", ALL, ids=lambda p: " ".join(p) or "phloem")
def test_help_has_examples_and_exits_zero(path: tuple[str, ...]) -> None:
    parser = dict(commands(build_parser()))[path]
    text = parser.format_help()
    assert "examples:" in text, f"`phloem {' '.join(path)} --help` has no examples"
    examples = text.split("examples:", 1)[1]
    assert f"phloem {' '.join(path)}".strip() in examples, "the examples use the command itself"
    result = subprocess.run([sys.executable, "-m", "phloem.cli", *path, "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "examples:" in result.stdout and result.stderr == ""


def test_the_console_script_answers_help() -> None:
    script = shutil.which("phloem")
    if script is None:
        pytest.skip("the `phloem` console script is not installed (pip install -e .)")
    result = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--log-format" in result.stdout and "examples:" in result.stdout


BENCHES = [path for path in ALL if len(path) == 2 and path[0] == "bench"]


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: " ".join(p))
def test_each_benchmark_help_is_its_own_with_defaults(path: tuple[str, ...]) -> None:
    """``phloem bench X --help`` shows X's examples only, and every flag that takes a value says
    what it defaults to."""
    parser = dict(commands(build_parser()))[path]
    examples = parser.format_help().split("examples:", 1)[1]
    others = [p[1] for p in BENCHES if p != path]
    assert not [o for o in others if f"phloem bench {o} " in examples], examples
    silent = [a.option_strings[-1] for a in parser._actions
              if a.option_strings and a.nargs != 0 and "default" not in (a.help or "")]
    assert not silent, f"`phloem {' '.join(path)}` flags without a default in their help: {silent}"
