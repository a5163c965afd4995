"""Progress bars for long work a person waits on: loading weights, capturing CUDA graphs, and
(through ``runtime.progress``) building the demo model and running benchmarks.

Decision: a bar is drawn only when it is asked for (``enabled`` is not ``False``) AND stderr is a
terminal. Logs, CI, pipes and tests never get one, so nothing here can break a test or garble a
log file; ``enabled=None`` means "whenever stderr is a terminal". The caller decides ``enabled``
(``phloem ... --no-progress`` and ``PHLOEM_NO_PROGRESS=1`` reach it as ``False``); this module
reads no environment variable. tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "progress_bar", "progress_shown"]

T = TypeVar("T")


def progress_shown(enabled: bool | None) -> bool:
    """Whether a bar would be drawn: ``enabled`` is not False and stderr is a terminal."""
    if enabled is False:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


@contextlib.contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "it",
                 enabled: bool | None = None) -> Iterator[Callable[[int], None]]:
    """A bar for ``total`` units of work; yields ``advance(n)`` (a no-op when no bar is drawn).

    Args:
        total: Units of work, if known.
        desc: What is being done (the bar's label).
        unit: The unit's name.
        enabled: False: never; None or True: when stderr is a terminal.

    Yields:
        ``advance(n)``: mark ``n`` more units done.
    """
    if not progress_shown(enabled):
        yield _ignore
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()


def progress(iterable: Iterable[T], total: int | None, desc: str, unit: str = "it",
             enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``iterable`` under a bar (see ``progress_bar``).

    Args:
        iterable: The work items.
        total: Their number, if known.
        desc: The bar's label.
        unit: The unit's name.
        enabled: False: never; None or True: when stderr is a terminal.

    Yields:
        The items of ``iterable``.
    """
    with progress_bar(total, desc, unit, enabled) as advance:
        for item in iterable:
            yield item
            advance(1)


def _ignore(n: int) -> None:
    del n
