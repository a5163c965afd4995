"""Every ``PHLOEM_*`` variable and every ``phloem`` flag the docs name exists in the code.

The pages: ``docs/*.md``, ``README.md`` and ``CONTRIBUTING.md``. A variable must be a row of
``runtime.env.VARIABLES``. A flag in a ``phloem <command>`` command line (a code block or an inline
span; ``python3 -m phloem.cli`` counts too) must be an option of that command's own parser; a
command line of another program (``OTHER_PROGRAMS``) is not checked; any other ``--flag`` (prose,
a table) must be an option of some ``phloem`` command, or one of ``OTHER_FLAGS``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from phloem.cli.main import build_parser
from phloem.runtime.env import VARIABLES

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "CONTRIBUTING.md"]
# The record of decisions names the switches it removed; it is history, not a reference.
VARIABLE_HISTORY = {"decisions.md"}
# Command lines that start with these run another program: their flags are not phloem's.
OTHER_PROGRAMS = {"python3", "python", "pytest", "pip", "docker", "redis-server", "bash", "curl", "hf"}
# Flags of other programs named in prose, away from their command line.
OTHER_FLAGS = {
    "--durations", "--durations-min",  # pytest (CONTRIBUTING.md)
    "--json", "--keep",  # docs/examples/agent.py (docs/sdk.md)
    "--preset",  # tools/train/train.py (docs/default-model.md)
    "--attention",  # benchmarks/sweeps/mixed_step.py (docs/benchmarks.md)
}
VARIABLE = re.compile(r"PHLOEM_[A-Z0-9_]*[A-Z0-9]")
SEGMENT = re.compile(r"`|\|\||\||&&|;|\(|\)")


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


PARSERS = dict(_parsers(build_parser()))
ROOT_FLAGS = {o for o in PARSERS[()]._option_string_actions if o.startswith("--")}
COMMAND_FLAGS = {path: {o for o in p._option_string_actions if o.startswith("--")} | ROOT_FLAGS
                 for path, p in PARSERS.items()}
ALL_FLAGS = set().union(*COMMAND_FLAGS.values())


def _flag(token: str) -> str | None:
    """The flag a token names (``--out=x.json`` and ``--shape's`` name ``--out``, ``--shape``), or None."""
    match = re.match(r"--[a-z][a-z0-9-]*", token.lstrip("\"'[{*"))
    return match.group() if match else None


def _lines(text: str) -> Iterator[tuple[int, str]]:
    """The page's lines with shell continuations (a trailing backslash) joined, numbered from 1."""
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending


def undocumented_flags(text: str) -> list[str]:
    """``line: --flag (where)`` for each flag ``text`` names that no parser it may belong to has."""
    problems = []
    for number, line in _lines(text):
        for segment in SEGMENT.split(line):
            tokens = segment.split()
            if not tokens:
                continue
            where = next((i for i, t in enumerate(tokens) if t in ("phloem", "phloem.cli")), None)
            if where is None and tokens[0].lstrip("$") in OTHER_PROGRAMS:
                continue
            if where is None:
                for token in tokens:
                    flag = _flag(token)
                    if flag is not None and flag not in ALL_FLAGS | OTHER_FLAGS:
                        problems.append(f"{number}: {flag} (no phloem command has it)")
                continue
            path: tuple[str, ...] = ()
            rest = tokens[where + 1:]
            while rest and (*path, rest[0]) in PARSERS:
                path, rest = (*path, rest[0]), rest[1:]
            allowed = COMMAND_FLAGS[path]
            if rest and rest[0] in ("…", "..."):  # `phloem bench … --tp`: any of its commands
                allowed = set().union(*(f for p, f in COMMAND_FLAGS.items() if p[:len(path)] == path))
            for token in rest:
                flag = _flag(token)
                if flag is not None and flag not in allowed:
                    problems.append(f"{number}: {flag} (not an option of `{' '.join(('phloem', *path))}`)")
    return problems


def unknown_variables(text: str) -> list[str]:
    known = {v.name for v in VARIABLES}
    return [f"{n}: {m}" for n, line in enumerate(text.splitlines(), 1) for m in VARIABLE.findall(line) if m not in known]


REFERENCE_PAGES = [p for p in PAGES if p.name not in VARIABLE_HISTORY]


@pytest.mark.parametrize("page", REFERENCE_PAGES, ids=[p.name for p in REFERENCE_PAGES])
def test_every_phloem_variable_a_page_names_exists(page: Path) -> None:
    assert unknown_variables(page.read_text()) == [], f"{page.name}: not in runtime/env.py VARIABLES"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_phloem_flag_a_page_names_exists(page: Path) -> None:
    assert undocumented_flags(page.read_text()) == [], f"{page.name}: flags the CLI does not have"


def test_the_checks_catch_a_missing_name() -> None:
    assert undocumented_flags("phloem serve --tp 2 --no-such-flag") == [
        "1: --no-such-flag (not an option of `phloem serve`)"
    ]
    # A flag of another command does not pass for this one, nor a made-up one in prose.
    assert undocumented_flags("`phloem bench decode --batches 1 --agents 4`") == [
        "1: --agents (not an option of `phloem bench decode`)"
    ]
    assert undocumented_flags("see `--bogus-flag`") == ["1: --bogus-flag (no phloem command has it)"]
    assert undocumented_flags("phloem serve \\\n    --port 1 --nope") == ["1: --nope (not an option of `phloem serve`)"]
    assert undocumented_flags("redis-server --daemonize yes") == []
    assert unknown_variables("PHLOEM_DATA_DIR and PHLOEM_NOT_A_VARIABLE") == ["1: PHLOEM_NOT_A_VARIABLE"]
