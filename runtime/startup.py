"""The start-up of ``phloem serve``, phase by phase, in the log: what runs now and what it took.

Each phase logs a line when it starts (so seconds of model loading are never silent) and an
event when it ends; ``ready`` sums them up once the server accepts connections::

    startup: loading the model from /models/Qwen3.5-35B-A3B on cuda (bfloat16)
    startup.phase phase=model seconds=41.2
    startup: warming up kernels (a few requests; compiled kernels are cached in /data/kernel-cache)
    startup.phase phase=warm_up seconds=9.7
    ...
    startup.ready seconds=52.3 url=http://127.0.0.1:8000 model=41.2 warm_up=9.7 sessions=0.1

On a terminal the long phases also draw progress bars (weights, CUDA graphs, warm-up requests:
``engine.progress_bars``); in a log file the lines above are what shows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from phloem.runtime.logs import log_event

__all__ = ["StartupLog"]

logger = logging.getLogger("phloem.startup")


class StartupLog:
    """Times the phases of one start-up, from its creation (the command's start) to ``ready``."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._phases: dict[str, float] = {}

    @property
    def phases(self) -> dict[str, float]:
        """Seconds of each finished phase, in order."""
        return dict(self._phases)

    @contextlib.contextmanager
    def phase(self, name: str, doing: str) -> Iterator[None]:
        """Log ``doing`` now and the phase's time when the block ends (also when it raises).

        Args:
            name: The phase's short name (``model``, ``warm_up``...): the event's field.
            doing: What a person reads meanwhile.
        """
        logger.info("startup: %s", doing)
        t0 = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - t0
            self._phases[name] = self._phases.get(name, 0.0) + seconds
            log_event(logger, "startup.phase", phase=name, seconds=round(seconds, 3))

    def ready(self, url: str) -> float:
        """Log that the server accepts requests at ``url``; returns the seconds since the start."""
        seconds = time.monotonic() - self._t0
        log_event(logger, "startup.ready", seconds=round(seconds, 3), url=url,
                  **{name: round(s, 3) for name, s in self._phases.items()})
        return seconds
