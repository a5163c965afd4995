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

from phloem.api.server.config import HttpConfig
from phloem.cli.config import ServerConfig
from phloem.cli.main import build_parser
from phloem.engine import config as engine_config
from phloem.runtime.env import PREFIX, VARIABLES, EnvSettings
from phloem.runtime.pd.roles import PDConfig
from phloem.sessions.config import SessionConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
CLASSES = [ServerConfig, HttpConfig, PDConfig, engine_config.EngineConfig, SessionConfig, engine_config.CacheConfig,
           engine_config.SchedulerConfig, engine_config.RunnerConfig, engine_config.ParallelConfig,
           engine_config.LoadConfig, engine_config.GrammarConfig, engine_config.SpeculativeConfig,
           engine_config.ModelConfig]
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
    names = [PREFIX + f.name.upper() for f in dataclasses.fields(EnvSettings)] + ["PHLOEM_KERNELS"]
    missing = [name for name in names if f"`{name}`" not in text]
    assert not missing, f"variables missing from {PAGE.name}: {missing}; {FIX}"


def test_the_variables_table_is_runtime_envs_table() -> None:
    """The page's variables are exactly ``runtime.env.VARIABLES``: each row's name, type, default
    and meaning, in order, and no other ``PHLOEM_*`` variable in a table of the page."""
    text = PAGE.read_text(encoding="utf-8")
    begin, end = "<!-- BEGIN GENERATED: env -->", "<!-- END GENERATED: env -->"
    rows = [line.split(" | ") for line in text[text.index(begin):text.index(end)].splitlines()
            if line.startswith("| `PHLOEM_")]
    cell = lambda value: " ".join(value.replace("|", "\\|").split())  # noqa: E731
    assert [(r[0], r[1], r[2], r[4].removesuffix(" |")) for r in rows] == [
        (f"| `{v.name}`", cell(v.type), cell(v.default), cell(v.help)) for v in VARIABLES
    ], f"the variables table differs from runtime.env.VARIABLES; {FIX}"
    elsewhere = {line.split("`")[1] for line in text.replace(text[text.index(begin):text.index(end)], "").splitlines()
                 if line.startswith("| `PHLOEM_")}
    assert not elsewhere, f"PHLOEM_* rows outside the generated table: {sorted(elsewhere)}"
    assert {v.name for v in VARIABLES} >= set(names_read_by_env()), "a variable runtime.env reads is not in VARIABLES"


def names_read_by_env() -> list[str]:
    """Every ``PHLOEM_*`` name ``runtime.env`` reads: the ``EnvSettings`` fields (each named after
    its variable) and the kernel variables (the rows ``kernel_config`` reads)."""
    from phloem.runtime import env

    return ([PREFIX + f.name.upper() for f in dataclasses.fields(EnvSettings)]
            + [v.name for v in env._KERNEL_VARIABLES])


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
