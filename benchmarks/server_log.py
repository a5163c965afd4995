"""Reading a ``phloem serve`` text log back (``runtime.logs``): its ``generation.finished`` events,
one a request, with the ``key=value`` fields ``sessions._events`` writes (turn, finish reason,
tokens, ``duration_ms``, ``prepare_ms``, ``first_token_ms``). The device tools read a served
run's per-turn timings from them (``tools/gpu/first_token.py``, ``tools/gpu/turn_rates.py``).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["finished_generations"]

_LINE = re.compile(r"^(\S+) .* generation\.finished (.*)$")


def finished_generations(path: str | Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``(timestamp, fields)`` of each ``generation.finished`` line of the log at ``path`` (plain,
    or gzipped when its name ends in ``.gz``); the fields as written (strings, ``None`` for a
    stateless request's turn)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as log:
        for line in log:
            m = _LINE.match(line)
            if m is not None:
                yield m.group(1), dict(part.split("=", 1) for part in m.group(2).split() if "=" in part)
