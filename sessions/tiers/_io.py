"""Storage I/O on thread pools of its own, never Python's default one.

``asyncio.to_thread`` shares the default executor with everything else in the process, so a
burst of slow work queued there by anyone (a tenant's request, a library) delays a durable
write behind it (issue 47: another tenant's append waited 122 s behind abandoned grammar
compiles). Two pools instead, made on first use and shared by the process's stores:

- ``DURABLE``: the journal and the index (every acknowledged turn waits for its journal write)
  and the start's load;
- ``SEGMENTS``: spilled segments' disk reads and writes, which are larger and slower, so a
  burst of spills never sits in front of a journal write.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["DURABLE", "SEGMENTS", "StoragePool"]

T = TypeVar("T")


class StoragePool:
    """A named thread pool for blocking storage calls, started on first use.

    Args:
        name: Its threads' name prefix.
        workers: Its threads.
    """

    def __init__(self, name: str, workers: int) -> None:
        self.name = name
        self.workers = workers
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on this pool; its result or exception."""
        call = functools.partial(fn, *args, **kwargs) if kwargs else functools.partial(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool(), call)

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._executor


DURABLE = StoragePool("phloem-journal", 4)
SEGMENTS = StoragePool("phloem-segments", 2)
