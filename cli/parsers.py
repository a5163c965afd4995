"""argparse helpers of the ``phloem`` command tree: the parser a command line reached, and short
usage lines.

A usage error (a flag argparse rejects, or a value the config rejects) prints the usage of the
command that was run, ``usage: phloem serve [options]``, and one ``phloem serve: error: ...``
line. The full list of a command's flags is ``phloem serve --help``: argparse's own usage line
for ``serve`` lists all of them and fills a screen above the one line that matters.
"""

from __future__ import annotations

import argparse

__all__ = ["command_parser", "shorten_usage"]


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` were parsed for: ``phloem bench decode``'s for
    ``phloem bench decode ...``; ``parser`` itself when it has no subcommands."""
    action = _subcommands(parser)
    chosen = getattr(args, action.dest, None) if action is not None else None
    if action is None or chosen not in action.choices:
        return parser
    return command_parser(action.choices[chosen], args)


def shorten_usage(parser: argparse.ArgumentParser) -> None:
    """Give every command below ``parser`` that takes options the usage ``PROG [options]``."""
    action = _subcommands(parser)
    for sub in action.choices.values() if action is not None else ():
        if _subcommands(sub) is None:
            sub.usage = "%(prog)s [options]"
        shorten_usage(sub)
