"""Grammar compiles on their own bounded pool, fair per owner, with a time budget per request.

A grammar compiles in xgrammar's C++ for up to a second or two within the limits
(``engine.sampling.grammar_limits``; 128 KiB of optional properties, the slowest measured);
``GrammarCompiles`` runs those compiles off the event loop
on ``compile_workers`` threads of its own (never Python's default pool, which the storage and
others use), and:

- each owner (API key) runs at most ``compile_per_owner`` compiles at once; its others wait in a
  queue of its own, so one key's burst of schemas never holds every worker;
- a request waits at most ``compile_timeout_s`` for its grammar, then gets ``InvalidRequest``
  (a 400 naming the budget);
- identical grammars in flight share one compile (the waiters count); one still queued behind
  its owner's backlog is taken over by another owner who asks for it with a free slot, so one
  key's queue never delays another key's request; when every request
  waiting for a compile that has not started goes away (a client that hung up, a timeout), the
  compile is dropped and never starts. One that started runs to the end (xgrammar cannot be
  interrupted inside a thread) and its grammar is kept in the cache, still charged to its owner:
  the owner's slot stays taken until it ends, so hanging up never frees a slot for more work.

Compiling in killable worker processes was measured and not taken: a compiled grammar crosses a
process only as JSON (``serialize_json``), which for a schema of 1,000 properties is 281 MB and
14 s to read back (docs/decisions.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from phloem.engine import GrammarConfig, GrammarSpec, InvalidRequest

if TYPE_CHECKING:
    from phloem.engine import GrammarStats

__all__ = ["GrammarCompiles"]


class _Backend(Protocol):
    """What ``GrammarCompiles`` uses of ``GrammarBackend`` (engine.sampling.grammar)."""

    config: GrammarConfig

    def check(self, spec: GrammarSpec) -> Any: ...
    def cached(self, spec: GrammarSpec) -> Any: ...
    def compile(self, spec: GrammarSpec, owner: str | None = None) -> Any: ...
    def stats(self) -> GrammarStats: ...


@dataclass(eq=False, slots=True)
class _Job:
    spec: GrammarSpec
    owner: str | None
    result: asyncio.Future[Any]
    waiters: int = 0
    started: bool = False
    thread_future: Future[Any] | None = field(default=None, repr=False)


class GrammarCompiles:
    """The compile pool of one ``GrammarBackend`` (module docstring). Use from one event loop.

    Args:
        backend: Checks, compiles and caches (thread-safe).
        config: Workers, per-owner concurrency and the time budget; None: the backend's.
    """

    def __init__(self, backend: _Backend, config: GrammarConfig | None = None) -> None:
        self._backend = backend
        self.config = config if config is not None else backend.config
        self._executor = ThreadPoolExecutor(self.config.compile_workers, thread_name_prefix="phloem-grammar")
        self._jobs: dict[GrammarSpec, _Job] = {}
        self._queued: dict[str | None, deque[_Job]] = {}
        self._running: dict[str | None, int] = {}
        self.num_timeouts = 0
        self.num_abandoned = 0

    async def compile(self, spec: GrammarSpec, owner: str | None = None) -> Any:
        """``spec``'s compiled grammar: from the cache, from a compile in flight, or compiled on
        the pool within ``owner``'s concurrency.

        Raises:
            InvalidRequest: past a limit, not compilable, or not compiled within the budget.
        """
        hit = self._backend.cached(spec)
        if hit is not None:
            return hit
        self._backend.check(spec)  # the limits, on the loop: a few ms for the largest allowed
        job = self._jobs.get(spec)
        if job is None:
            job = self._jobs[spec] = _Job(spec, owner, asyncio.get_running_loop().create_future())
            self._queued.setdefault(owner, deque()).append(job)
            self._pump(owner)
        elif not job.started and job.owner != owner and self.running(owner) < self.config.compile_per_owner:
            # Queued behind another owner's backlog, and this owner has a free slot: it takes
            # the compile over (and its cache charge), so no owner's queue delays another's.
            self._unqueue(job)
            job.owner = owner
            self._queued.setdefault(owner, deque()).appendleft(job)
            self._pump(owner)
        job.waiters += 1
        budget = self.config.compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(job.result), budget)
        except TimeoutError:
            self.num_timeouts += 1
            raise InvalidRequest(
                f"grammar: not compiled within the {budget:g} s budget (compile_timeout_s); send a smaller schema"
            ) from None
        finally:
            job.waiters -= 1
            if not job.waiters and not job.started and not job.result.done():
                self._abandon(job)

    def stats(self, stats: GrammarStats) -> GrammarStats:
        """The backend's ``stats`` with this pool's counters."""
        return replace(stats, timeouts=self.num_timeouts, abandoned=self.num_abandoned)

    def queued(self, owner: str | None) -> int:
        """Compiles of ``owner`` waiting for a slot."""
        return len(self._queued.get(owner, ()))

    def running(self, owner: str | None) -> int:
        """Compiles of ``owner`` on the pool (started or waiting for a thread)."""
        return self._running.get(owner, 0)

    def close(self) -> None:
        """Start no more compiles (ones running finish on their threads); waiters fail."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        for job in list(self._jobs.values()):
            # Maybe from another thread or loop than the waiters' (a test's shutdown): on theirs.
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                job.result.get_loop().call_soon_threadsafe(_fail, job.result)
        self._jobs.clear()
        self._queued.clear()

    def _pump(self, owner: str | None) -> None:
        """Start ``owner``'s queued compiles while it has free slots."""
        queue = self._queued.get(owner)
        while queue and self._running.get(owner, 0) < self.config.compile_per_owner:
            job = queue.popleft()
            job.started = True
            self._running[owner] = self._running.get(owner, 0) + 1
            loop = asyncio.get_running_loop()
            job.thread_future = self._executor.submit(self._backend.compile, job.spec, owner)
            job.thread_future.add_done_callback(functools.partial(self._finished_threadsafe, loop, job))
        if queue is not None and not queue:
            del self._queued[owner]

    def _finished_threadsafe(self, loop: asyncio.AbstractEventLoop, job: _Job, done: Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(self._finished, job, done)

    def _finished(self, job: _Job, done: Future[Any]) -> None:
        """A compile ended (on the loop): free its slot, wake its waiters, start the next."""
        owner = job.owner
        self._running[owner] -= 1
        if not self._running[owner]:
            del self._running[owner]
        if self._jobs.get(job.spec) is job:
            del self._jobs[job.spec]
        if not job.result.done():
            if done.cancelled():
                job.result.set_exception(InvalidRequest("grammar: the server is shutting down"))
            elif (exc := done.exception()) is not None:
                job.result.set_exception(exc)
            else:
                job.result.set_result(done.result())
            if not job.waiters:
                with contextlib.suppress(BaseException):
                    job.result.exception()  # mark it retrieved: nobody waits for it
        self._pump(owner)

    def _unqueue(self, job: _Job) -> None:
        queue = self._queued.get(job.owner)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(job)
            if not queue:
                del self._queued[job.owner]

    def _abandon(self, job: _Job) -> None:
        """Nobody waits for ``job`` any more and it has not started: drop it."""
        self.num_abandoned += 1
        self._unqueue(job)
        if self._jobs.get(job.spec) is job:
            del self._jobs[job.spec]
        job.result.cancel()


def _fail(result: asyncio.Future[Any]) -> None:
    if not result.done():
        result.set_exception(InvalidRequest("grammar: the server is shutting down"))
        result.exception()  # retrieved: its waiters may be gone
