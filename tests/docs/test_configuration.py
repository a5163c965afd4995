"""``docs/configuration.md`` names every CLI flag, ``PHLOEM_*`` variable and config field.

Checked against the code directly (the argparse parser of ``build_parser`` and
``dataclasses.fields``), not against the generator, so a generator bug that drops a row fails
here too. Each flag must appear in its own command's section and each field in its own class's
table.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from phloem.engine import config as engine_config
from phloem.kernels.dispatch import ENV_VAR as KERNELS_ENV_VAR
from phloem.runtime.cli import build_parser
from phloem.runtime.config import ServerConfig
from phloem.runtime.env import PREFIX, EnvSettings
from phloem.sessions.config import SessionConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
CLASSES = [ServerConfig, engine_config.EngineConfig, SessionConfig, engine_config.CacheConfig,
           engine_config.SchedulerConfig, engine_config.RunnerConfig, engine_config.ParallelConfig,
           engine_config.LoadConfig, engine_config.ModelConfig]
FIX = "regenerate with `python3 docs/reference/generate.py`"


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _commands(sub)


def _section(text: str, heading: str) -> str:
    """The text from ``heading`` (a whole line) to the next heading of the same level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    following = re.search(rf"^{level} ", text[start + len(heading):], re.M)
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def _flags() -> list[tuple[str, str]]:
    parser = build_parser(EnvSettings())
    return [(sub.prog, flag) for sub in _commands(parser) for action in sub._actions
            for flag in action.option_strings if flag not in ("-h", "--help")]


@pytest.mark.parametrize(("prog", "flag"), _flags(), ids=lambda value: value)
def test_every_cli_flag_is_documented_under_its_command(prog: str, flag: str) -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert f"### `{prog}`\n" in text, f"no section for `{prog}` in {PAGE.name}; {FIX}"
    assert f"`{flag}`" in _section(text, f"### `{prog}`"), f"`{prog} {flag}` missing; {FIX}"


def test_serve_flags_are_documented() -> None:
    """The page documents `phloem serve` at least (the parser walk found it)."""
    assert any(prog == "phloem serve" and flag == "--port" for prog, flag in _flags())


def test_every_environment_variable_is_documented() -> None:
    text = PAGE.read_text(encoding="utf-8")
    names = [PREFIX + f.name.upper() for f in dataclasses.fields(EnvSettings)] + [KERNELS_ENV_VAR]
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"variables missing from {PAGE.name}: {missing}; {FIX}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_config_field_is_documented(cls: type) -> None:
    text = PAGE.read_text(encoding="utf-8")
    begin, end = f"<!-- BEGIN GENERATED: {cls.__name__} -->", f"<!-- END GENERATED: {cls.__name__} -->"
    assert begin in text and end in text, f"no table for {cls.__name__} in {PAGE.name}"
    table = text[text.index(begin):text.index(end)]
    missing = [f.name for f in dataclasses.fields(cls) if f"| `{f.name}` |" not in table]
    assert not missing, f"{cls.__name__} fields missing from {PAGE.name}: {missing}; {FIX}"
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(dataclasses.fields(cls)), f"{cls.__name__}: stale rows; {FIX}"
