"""Tokenizing and rendering chat templates off the event loop, a bounded number per owner.

A long text takes seconds to tokenize; on the event loop that stalls every other request,
stream and ``/health`` for as long. ``TokenizePool`` runs that work on a few worker threads (the
Rust tokenizer releases the GIL while it works; jinja rendering yields it every few ms), and
lets each owner (API key) run at most ``per_owner`` jobs at once: an owner's further jobs wait
for its own earlier ones, so one key sending huge bodies in parallel cannot occupy every worker
while other keys' requests queue behind it. ``close`` stops taking work; a job already running
finishes on its thread.

Inputs that cannot fit the context window are refused before they reach the pool
(``sessions._inputs.check_input_size``), from their character count alone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["TokenizePool", "default_workers"]

T = TypeVar("T")


def default_workers() -> int:
    """Workers sized to the machine: its CPUs, at least 2, at most 8."""
    return max(2, min(8, os.cpu_count() or 2))


class TokenizePool:
    """A thread pool for tokenization, with a per-owner bound.

    Args:
        workers: Threads (0: ``default_workers()``).
        per_owner: Jobs one owner runs at once (>= 1).
    """

    def __init__(self, workers: int = 0, per_owner: int = 2) -> None:
        assert workers >= 0 and per_owner >= 1, f"workers {workers}, per_owner {per_owner}"
        self._executor = ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="phloem-tokenize")
        self._per_owner = per_owner
        self._slots: dict[str | None, asyncio.Semaphore] = {}
        self._waiting: dict[str | None, int] = {}

    async def run(self, owner: str | None, job: Callable[[], T]) -> T:
        """Run ``job`` on a worker thread once ``owner`` has a free slot; its result or exception.

        Args:
            owner: Whose quota it counts against.
            job: The work (tokenize, render); it must not touch the event loop.
        """
        slots = self._slots.get(owner)
        if slots is None:
            slots = self._slots[owner] = asyncio.Semaphore(self._per_owner)
        self._waiting[owner] = self._waiting.get(owner, 0) + 1
        try:
            async with slots:
                return await asyncio.get_running_loop().run_in_executor(self._executor, job)
        finally:
            self._waiting[owner] -= 1
            if not self._waiting[owner]:
                # Forget idle owners: the maps hold only owners with work in flight.
                del self._waiting[owner], self._slots[owner]

    def close(self) -> None:
        """Take no more work (jobs running finish on their threads)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
