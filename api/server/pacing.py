"""Pacing of a streamed generation: keep-alives while it is quiet, cancellation once it idles.

Every stream (SSE append, WebSocket append, OpenAI ``stream: true``) reads its generation's
deltas through ``paced_deltas``. While no delta comes it yields ``None`` every ``keepalive_s``
(an SSE ``: keep-alive`` comment). After ``idle_timeout_s`` without a delta it cancels the
generation: as for any cancel, the tokens generated so far still come as deltas, the turn is
committed with ``finish_reason == "cancelled"`` and the stream ends with its ``done``, so the
stream always closes cleanly and the engine frees the request's pages and slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from phloem.sessions import Generation, OutputDelta

__all__ = ["paced_deltas"]

logger = logging.getLogger(__name__)


async def paced_deltas(generation: Generation, idle_timeout_s: float,
                       keepalive_s: float) -> AsyncIterator[OutputDelta | None]:
    """The generation's deltas, ``None`` for each ``keepalive_s`` without one.

    Args:
        generation: A started generation (this is its one consumer).
        idle_timeout_s: Cancel it after this long without a delta.
        keepalive_s: Yield ``None`` after this long without a delta.

    Yields:
        Deltas, or ``None`` when a keep-alive is due; ends when the output is complete
        (``generation.result()`` then has the settled turn).
    """
    loop = asyncio.get_running_loop()
    deltas = generation.deltas()
    pending: asyncio.Future[Any] | None = None
    last_delta = loop.time()
    cancelled = False
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(deltas, None))
            idle_left = last_delta + idle_timeout_s - loop.time()
            wait = keepalive_s if cancelled else max(0.0, min(keepalive_s, idle_left))
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if not done:
                if not cancelled and loop.time() - last_delta >= idle_timeout_s:
                    cancelled = True
                    logger.warning("generation %s produced nothing for %.0f s: cancelled",
                                   generation.request_id, idle_timeout_s)
                    generation.cancel()
                else:
                    yield None
                continue
            delta, pending = pending.result(), None
            if delta is None:
                return
            last_delta = loop.time()
            yield delta
    finally:
        if pending is not None:
            pending.cancel()
