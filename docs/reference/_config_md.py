"""The generated tables of ``docs/configuration.md``: CLI flags, ``PHLOEM_*`` variables, dataclasses.

``docs/configuration.md`` is written by hand, except blocks between
``<!-- BEGIN GENERATED: NAME -->`` and ``<!-- END GENERATED: NAME -->``, which ``fill_blocks``
replaces. Every block the generator knows must be on the page and every block on the page must
be known, so nothing is silently dropped.

Sources, all read from the code:

- flags: ``phloem.cli.main.build_parser`` built with an empty environment (so a developer's
  ``PHLOEM_*`` variables never leak into the page), every subcommand, every argument group;
  help texts are expanded as ``--help`` expands them;
- variables: the rows of ``runtime.env.VARIABLES`` (``EnvSettings`` is generated from them);
  which flags a variable feeds is found by building the parser with only that
  variable set to a sentinel and looking for the flags whose default became the sentinel;
- dataclasses: ``dataclasses.fields`` (type as annotated, default or default factory) and the
  meaning from the class docstring's ``Args:`` section (``a / b: text`` documents both).

Decision: a field or variable without a documented meaning is an error (``MissingDoc``), not a
blank cell: the fix is one line in the docstring, and the page never goes stale silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MissingDoc", "commands", "dataclass_table", "docstring_args", "env_table",
           "fill_blocks", "flag_tables"]

_BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- END GENERATED: (?P=name) -->)", re.S)


class MissingDoc(ValueError):
    """A configuration knob has no documented meaning (or a block is unknown or absent)."""


def _cell(text: str) -> str:
    return " ".join(str(text).replace("|", "\\|").split()) or "—"


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command that takes flags, depth first: ``("phloem serve", parser)``, ..."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub.prog, sub
                yield from commands(sub)


def _expand_help(action: argparse.Action, prog: str) -> str:
    """The help text as ``--help`` prints it (``%(default)s`` and friends filled in)."""
    params: dict[str, Any] = dict(vars(action), prog=prog)
    for name, value in list(params.items()):
        if value is argparse.SUPPRESS:
            del params[name]
        elif hasattr(value, "__name__"):
            params[name] = value.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return (action.help or "") % params


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar is not None:
        return f"`{action.metavar}`"
    kind = getattr(action.type, "__name__", None)
    return f"`{action.dest.upper()}`" + (f" ({kind})" if kind and kind not in ("str", "_ints") else "")


def _default(value: object) -> str:
    if value is None or value is argparse.SUPPRESS:
        return "—"
    if value is False:
        return "off"
    if isinstance(value, tuple):
        return f"`{','.join(str(v) for v in value)}`"
    return f"`{value}`"


def flag_tables(parser: argparse.ArgumentParser, env_flags: dict[str, str]) -> list[str]:
    """One section per command, one table per argument group.

    Args:
        parser: ``build_parser`` of an empty environment.
        env_flags: ``"phloem serve --host"`` → ``PHLOEM_HOST`` for flags whose default comes from
            a variable.
    """
    lines: list[str] = []
    for prog, sub in commands(parser):
        groups = [g for g in sub._action_groups if any(_is_flag(a) for a in g._group_actions)]
        if not groups:
            continue
        lines += [f"### `{prog}`", ""]
        lines += [_cell(sub.description), ""] if sub.description else []
        for group in groups:
            if group.title not in ("options", "optional arguments"):
                lines += [f"**{group.title}**: {_cell(group.description or '')}", ""]
            lines += ["| flag | value | default | from env | meaning |", "|---|---|---|---|---|"]
            for action in (a for a in group._group_actions if _is_flag(a)):
                flags = ", ".join(f"`{f}`" for f in action.option_strings)
                env = env_flags.get(f"{prog} {action.option_strings[-1]}", "")
                row = [flags, _value(action), _default(action.default),
                       f"`{env}`" if env else "—", _cell(_expand_help(action, prog))]
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    return lines


def _is_flag(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not isinstance(action, argparse._HelpAction)


def env_table(variables: Sequence[Any], used_by: dict[str, list[str]]) -> list[str]:
    """The variables table: one row per ``runtime.env.VARIABLES`` entry, in its order (``used_by``:
    the flags each variable feeds)."""
    lines = ["| variable | type | default | feeds | meaning |", "|---|---|---|---|---|"]
    for var in variables:
        feeds = ", ".join(f"`{f}`" for f in used_by.get(var.name, [])) or "—"
        lines.append(f"| `{var.name}` | {_cell(var.type)} | {_cell(var.default)} | {feeds} | {_cell(var.help)} |")
    return lines


def docstring_args(doc: str) -> dict[str, str]:
    """Parse a Google docstring's ``Args:`` section; ``a / b: text`` gives both names ``text``."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return {}
    base = len(lines[start]) - len(lines[start].lstrip())
    found: dict[str, str] = {}
    names: list[str] = []
    entry_indent = None
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent <= base:
            break
        if not line.strip():
            continue
        entry_indent = entry_indent if entry_indent is not None else indent
        match = re.match(r"^([\w ,/]+):\s*(.*)$", line.strip())
        if indent == entry_indent and match:
            names = [n.strip() for n in re.split(r"[/,]", match.group(1)) if n.strip()]
            for name in names:
                found[name] = match.group(2)
        else:
            for name in names:
                found[name] += " " + line.strip()
    return found


def _factory_text(factory: Callable[[], Any]) -> str:
    doc = (factory.__doc__ or "").strip().split("\n\n")[0]
    return f"`{factory.__name__}()`: " + " ".join(doc.replace("``", "`").split())


def dataclass_table(cls: type, fallback: Callable[[str], str] | None = None) -> list[str]:
    """The field table of a dataclass: field, type, default, meaning.

    Args:
        cls: The dataclass.
        fallback: Meaning of a field the docstring does not describe; None: that is an error.

    Raises:
        MissingDoc: A field has no meaning.
    """
    meanings = docstring_args(cls.__doc__ or "")
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`"
        elif f.default_factory is not dataclasses.MISSING:
            default = _factory_text(f.default_factory)
        else:
            default = "required"
        meaning = meanings.get(f.name) or (fallback(f.name) if fallback else None)
        if not meaning:
            raise MissingDoc(f"{cls.__module__}.{cls.__qualname__}.{f.name}: no meaning; document "
                             "it in the class docstring's Args section")
        lines.append(f"| `{f.name}` | `{_cell(f.type)}` | {_cell(default)} | "
                     f"{_cell(meaning.replace('``', '`'))} |")
    return lines


def fill_blocks(page: str, blocks: dict[str, list[str]], where: Path) -> str:
    """Replace the body of every generated block of ``page``.

    Raises:
        MissingDoc: The page has a block the generator does not know, or lacks one it does.
    """
    seen: set[str] = set()

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in blocks:
            raise MissingDoc(f"{where}: unknown generated block {name!r}; known: {sorted(blocks)}")
        seen.add(name)
        body = "\n".join(blocks[name]).strip("\n")
        return f"{match.group(1)}{body}\n{match.group(4)}"

    result = _BLOCK.sub(replace, page)
    missing = sorted(set(blocks) - seen)
    if missing:
        raise MissingDoc(f"{where}: missing generated block(s) {missing}; add "
                         "<!-- BEGIN GENERATED: NAME --> / <!-- END GENERATED: NAME --> pairs")
    return result
