"""Progress bars for the runtime's long work (building the demo model, benchmarks) and the
benchmark drivers above it: the engine's one implementation (``engine.progress_bars``), re-exported
from ``phloem.engine``.

A bar is drawn only when ``enabled`` is not False and stderr is a terminal; ``phloem ...
--no-progress`` and ``PHLOEM_NO_PROGRESS=1`` (``runtime.env``) make it False.
"""

from __future__ import annotations

from phloem.engine import progress, progress_bar, progress_shown

__all__ = ["progress", "progress_bar", "progress_shown"]
