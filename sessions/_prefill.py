"""``SharedPrefill``: a prompt computed once for the ``n`` choices of one request.

The ``n`` generations of a completion with ``n > 1`` are forks of one prompt. Before any of them
is sent to the engine, a prefill-only request computes every prompt token but the last and
publishes them in the prefix cache; each choice then takes those pages and the GDN checkpoint
from the cache (copy-on-write: at most the partial last page is copied) and computes one token
before it samples. Without a prefix cache, or when the cache had to evict the prefix in the
meantime, a choice simply computes the prompt itself: the tokens are the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phloem.engine import EngineError, SamplingParams

if TYPE_CHECKING:
    from phloem.runtime import EngineClient

__all__ = ["SharedPrefill"]

logger = logging.getLogger(__name__)


class SharedPrefill:
    """Runs the prefill once, for every generation that ``wait``s on it.

    Args:
        engine: The engine client.
        prompt_ids: The prompt of the ``n`` choices (at least two tokens).
        namespace: The prefix-cache namespace (owner) the choices read from.
    """

    def __init__(self, engine: EngineClient, prompt_ids: Sequence[int], namespace: str | None = None) -> None:
        assert len(prompt_ids) >= 2, "a shared prefill leaves the last prompt token to each choice"
        self._engine = engine
        self._prefix = list(prompt_ids[:-1])
        self._namespace = namespace
        self._task: asyncio.Task[None] | None = None
        self.num_cached_tokens = 0  # what the cache held of the prompt before the prefill

    async def wait(self) -> None:
        """Start the prefill (first caller) and wait for it; never raises (a failed prefill
        leaves each choice to compute the prompt itself)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="shared-prefill")
        await asyncio.shield(self._task)

    async def _run(self) -> None:
        params = SamplingParams(max_tokens=1)
        try:
            async for out in self._engine.generate(self._prefix, params, prefill_only=True, namespace=self._namespace):
                self.num_cached_tokens = out.num_cached_tokens
        except EngineError as exc:
            logger.warning("shared prefill of %d tokens failed (%s); each choice computes it", len(self._prefix), exc)
