"""The engine loop: one daemon thread that owns the ``Engine`` and is the only one to touch it.

Other threads talk to it with typed commands (``runtime.engine_commands``: frozen dataclasses,
dispatched on their type) put on a thread-safe queue. Each carries a ``Future`` for its reply; a
request's outputs go to the ``OutputSink`` its ``AddRequest`` supplied, called on the engine
thread (it must not block: the asyncio bridge hands the item to its event loop and returns).

One iteration::

    drain commands (block on the queue only when the engine has no work)
      -> apply them in arrival order (add, abort, pin, ...)
      -> engine.step() once if there is work
      -> route each RequestOutput to its request's sink

A request's final output comes one step before its turn-end checkpoint is in the prefix cache
(the engine computes the last token once more to publish it). So a prefix query (``PinPrefix``,
``QueryCachedPrefix``, ``ExportPrefix``, ``ReserveTransfer``) that arrives while such a checkpoint is pending is
answered after the next step: a session that pins or spills its new head right after a turn gets
the whole turn.

An exception in ``step()`` never kills the thread: it is logged, every in-flight request is
aborted in the engine (freeing its pages and slots) and its sink gets an ``EngineError`` whose
``__cause__`` is the original exception; the loop then waits for the next command before it steps
again, so an engine that keeps failing cannot spin the thread. Nor can requests that wait while
nothing runs (pinned sessions hold the memory they need, until the sessions layer relieves them):
after such a step the loop waits up to ``_STALL_WAIT_S`` for a command before it tries again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from phloem.engine import Engine, EngineError, InvalidRequest, RadixNode, RequestOutput
from phloem.runtime.engine_commands import (
    AbortRequest,
    AddRequest,
    Command,
    EngineStats,
    ExportPrefix,
    GetStats,
    ImportPrefix,
    InstallTransfer,
    OutputSink,
    PinPrefix,
    QueryCachedPrefix,
    QueryWaitsForMemory,
    AttachResume,
    ReleaseTransfer,
    ReserveTransfer,
    ResetPrefixCache,
    Shutdown,
    UnpinPrefix,
)
from phloem.runtime.histogram import STEP_KINDS, STEP_SECONDS_BOUNDS, Histogram

__all__ = ["EngineLoop"]

logger = logging.getLogger(__name__)

_MAX_CLOSING_STEPS = 4
# A stalled engine (requests wait, nothing runs) retries admission this often, or at a command.
_STALL_WAIT_S = 0.01


@dataclass(slots=True)
class _InFlight:
    sink: OutputSink
    prompt_token_ids: list[int]
    last: RequestOutput | None = None


class EngineLoop:
    """Runs an ``Engine`` on a daemon thread and serves commands.

    Args:
        engine: The engine; after ``start`` no other thread may touch it until ``shutdown``
            returns (then it is safe to inspect, e.g. in tests).
        name: The thread's name.
    """

    def __init__(self, engine: Engine, name: str = "phloem-engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # Guards the state together with ``put`` so no command lands after the final drain.
        self._lock = threading.Lock()
        self._state = "new"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._inflight: dict[str, _InFlight] = {}
        self._paused = False
        # Prefix queries waiting for the next step (see ``_dispatch``); their futures are running.
        self._parked: list[PinPrefix | QueryCachedPrefix | ExportPrefix | ReserveTransfer] = []
        self._num_steps = 0
        self._num_failed_steps = 0
        self._step_seconds = Histogram(STEP_SECONDS_BOUNDS)
        # Per kind of step collected (``Engine.last_step_kind``), and the host time the loop spends
        # between two steps while requests are in flight (commands, delivering outputs): where a
        # served decode step's time goes beside the forward itself.
        self._kind_seconds = {kind: Histogram(STEP_SECONDS_BOUNDS) for kind in STEP_KINDS}
        self._between_steps_s = 0.0
        # Engine-thread seconds answering commands, by command (a spill's export copies the
        # session's state while every running request waits: what the time between steps was).
        self._command_seconds: dict[str, float] = {}

    @property
    def is_running(self) -> bool:
        return self._state == "running"

    def start(self) -> None:
        """Start the thread.

        Raises:
            RuntimeError: it was started before.
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"EngineLoop.start: expected a new loop, got a {self._state} one")
            self._state = "running"
        self._thread.start()

    def submit(self, command: Command) -> None:
        """Queue ``command``; its reply future resolves on the engine thread.

        Raises:
            EngineError: the loop is not running (not started, shut down, or crashed).
        """
        with self._lock:
            if self._state != "running":
                raise EngineError(f"engine loop: expected a running loop, got a {self._state} one")
            self._commands.put(command)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread (a no-op unless running) and wait for it.

        Raises:
            TimeoutError: it did not stop within ``timeout`` seconds.
        """
        command = Shutdown()
        try:
            self.submit(command)
        except EngineError:
            pass  # not running: nothing to stop
        else:
            command.reply.result(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"engine loop: the thread did not stop within {timeout} s")

    def _run(self) -> None:
        stops: list[Future[None]] = []
        try:
            self.engine.bind_thread()
            stalled = False
            while not stops:
                block = self._paused or not self.engine.has_unfinished_requests()
                started = time.perf_counter()
                for command in self._drain(block, _STALL_WAIT_S if stalled else None):
                    self._paused = False
                    if isinstance(command, Shutdown):
                        stops.append(command.reply)
                    elif not stops:
                        self._dispatch(command)
                    else:
                        _refuse(command)
                stalled = False
                if not stops and not self._paused and self.engine.has_unfinished_requests():
                    if not block:
                        self._between_steps_s += time.perf_counter() - started
                    self._step()
                    stalled = self.engine.is_stalled()
        except Exception:
            # A bug in the loop itself: stop, but fail every waiter rather than leave it hanging.
            logger.exception("engine loop crashed; failing every request in flight")
        finally:
            self._close(stops)

    def _drain(self, block: bool, wait_s: float | None = None) -> list[Command]:
        """Every queued command; with ``block`` at least one; with ``wait_s`` whatever comes within it."""
        commands: list[Command] = []
        if block or wait_s is not None:
            try:
                commands.append(self._commands.get(timeout=None if block else wait_s))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _dispatch(self, command: Command) -> None:
        # A reply future cancelled before we got to it means "never mind": skip the command.
        if not command.reply.set_running_or_notify_cancel():
            return
        parkable = PinPrefix | QueryCachedPrefix | ExportPrefix | ReserveTransfer
        unsettled = isinstance(command, QueryCachedPrefix) and not command.settled
        if isinstance(command, parkable) and not unsettled and self.engine.scheduler.num_finalizing():
            # A request that just finished publishes its turn-end checkpoint in the next step;
            # a prefix query answered now would miss it (e.g. a session pinning its new head).
            self._parked.append(command)
            return
        self._answer(command)

    def _answer(self, command: Command) -> None:
        start = time.perf_counter()
        try:
            self._execute(command)
        finally:
            name = type(command).__name__
            self._command_seconds[name] = self._command_seconds.get(name, 0.0) + time.perf_counter() - start

    def _execute(self, command: Command) -> None:
        try:
            match command:
                case AddRequest():
                    result: object = self._add(command)
                case AbortRequest(request_id=request_id, sink=sink):
                    result = self._abort(request_id, sink)
                case PinPrefix(token_ids=token_ids, namespace=ns):
                    result = self.engine.pin_prefix(token_ids, ns)
                case UnpinPrefix(handle=handle):
                    if not isinstance(handle, RadixNode):
                        raise InvalidRequest(f"handle: expected a handle from pin_prefix, got {handle!r}")
                    self.engine.unpin_prefix(handle)
                    result = None
                case QueryCachedPrefix(token_ids=token_ids, namespace=ns):
                    result = self.engine.cached_prefix_len(token_ids, ns)
                case QueryWaitsForMemory(request_id=request_id):
                    result = self.engine.waits_for_memory(request_id)
                case AttachResume(request_id=request_id, state=state):
                    result = self.engine.attach_resume(request_id, state)
                case ExportPrefix(token_ids=token_ids, namespace=ns, host_alloc=host_alloc):
                    result = self.engine.export_prefix(token_ids, ns, host_alloc)
                case ImportPrefix(state=state, namespace=ns):
                    result = self.engine.import_prefix(state, ns)
                case ReserveTransfer(token_ids=token_ids, params=params, local_up_to=local_up_to, namespace=ns):
                    result = self.engine.reserve_transfer(token_ids, params, local_up_to, ns)
                case InstallTransfer(reservation=res, kv=kv, conv=conv, ssm=ssm):
                    self.engine.install_transfer(res, kv, conv, ssm)
                    result = None
                case ReleaseTransfer(reservation=res):
                    self.engine.release_transfer(res)
                    result = None
                case ResetPrefixCache():
                    self._reset_prefix_cache()
                    result = None
                case GetStats():
                    result = self._stats()
                case _:
                    raise AssertionError(f"engine loop: unknown command {type(command).__name__}")
        except Exception as exc:
            command.reply.set_exception(exc)
        else:
            command.reply.set_result(result)  # type: ignore[arg-type]

    def _reset_prefix_cache(self) -> None:
        # NOTE: the engine has no public reset yet; RadixCache.clear() keeps locked nodes (pins,
        # running requests) and frees the rest, which is exactly a reset.
        tree = self.engine.cache.tree
        if tree is not None:
            tree.clear()

    def _add(self, command: AddRequest) -> str:
        prompt = list(command.prompt_token_ids)
        request_id = self.engine.add_request(
            prompt, command.params, command.request_id, output_token_ids=command.output_token_ids,
            namespace=command.namespace, prefill_only=command.prefill_only, hold_turn_end=command.hold_turn_end,
            resume=command.resume,
        )
        self._inflight[request_id] = _InFlight(command.sink, prompt)
        return request_id

    def _abort(self, request_id: str, sink: OutputSink | None) -> bool:
        entry = self._inflight.get(request_id)
        if entry is None or (sink is not None and entry.sink is not sink):
            return False
        del self._inflight[request_id]
        aborted = self.engine.abort_request(request_id)
        last = entry.last
        final = RequestOutput(
            request_id=request_id,
            prompt_token_ids=entry.prompt_token_ids,
            token_ids=list(last.token_ids) if last else [],
            new_token_ids=[],
            finished=True,
            finish_reason="abort",
            num_cached_tokens=last.num_cached_tokens if last else 0,
            num_resumed_tokens=last.num_resumed_tokens if last else 0,
        )
        self._deliver(request_id, entry.sink, final)
        return aborted

    def _step(self) -> None:
        parked, self._parked = self._parked, []
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._step_seconds.observe(time.perf_counter() - start)
            self._num_failed_steps += 1
            self._paused = True
            logger.exception("engine step failed; failing %d request(s) in flight", len(self._inflight))
            self._fail_all(f"engine step failed: {exc!r}", exc)
            outputs = []
        else:
            elapsed = time.perf_counter() - start
            self._step_seconds.observe(elapsed)
            self._kind_seconds[self.engine.last_step_kind].observe(elapsed)
            self._num_steps += 1
        delivered = time.perf_counter()
        for command in parked:
            self._answer(command)
        for out in outputs:
            entry = self._inflight.get(out.request_id)
            if entry is None:
                continue
            if out.finished:
                del self._inflight[out.request_id]
            else:
                entry.last = out
            self._deliver(out.request_id, entry.sink, out)
        self._between_steps_s += time.perf_counter() - delivered

    def _deliver(self, request_id: str, sink: OutputSink, item: RequestOutput | EngineError) -> None:
        try:
            sink(item)
        except Exception:
            # The consumer is gone (e.g. its event loop closed): free the request's memory.
            logger.exception("output sink of request %r raised; aborting the request", request_id)
            if self._inflight.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)

    def _fail_all(self, message: str, cause: BaseException | None) -> None:
        """Abort every in-flight request in the engine and send each sink its own ``EngineError``."""
        inflight, self._inflight = self._inflight, {}
        for request_id, entry in inflight.items():
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("engine loop: aborting request %r failed", request_id)
            error = EngineError(message)
            error.__cause__ = cause
            self._deliver(request_id, entry.sink, error)

    def _stats(self) -> EngineStats:
        pages, slots = self.engine.page_pool, self.engine.slot_pool
        return EngineStats(
            cache=self.engine.cache_stats(),
            num_pages=pages.num_pages,
            num_free_pages=pages.num_free_pages,
            num_slots=slots.num_slots,
            num_free_slots=slots.num_free_slots,
            num_requests=len(self._inflight),
            num_steps=self._num_steps,
            num_failed_steps=self._num_failed_steps,
            num_waiting=len(self.engine.scheduler.waiting),
            num_running=len(self.engine.scheduler.running),
            step_seconds=self._step_seconds.snapshot(),
            memory_blocked=self.engine.scheduler.memory_blocked,
            step_kind_seconds={kind: h.snapshot() for kind, h in self._kind_seconds.items()},
            between_steps_seconds=self._between_steps_s,
            command_seconds=dict(self._command_seconds),
            num_pipelined_steps=self.engine.num_pipelined_steps,
            num_pipelined_mixed_steps=self.engine.num_pipelined_mixed_steps,
            num_preemptions=self.engine.scheduler.num_preemptions,
            speculation=self.engine.speculation_stats(),
        )

    def _close(self, stops: list[Future[None]]) -> None:
        with self._lock:
            self._state = "stopped"
        # No command can be queued any more: refuse what is left, then fail what is in flight.
        for command in self._drain(block=False):
            if isinstance(command, Shutdown):
                stops.append(command.reply)
            else:
                _refuse(command)
        self._fail_all("the engine loop shut down", None)
        self._land_checkpoints()
        parked, self._parked = self._parked, []
        for command in parked:
            self._answer(command)
        for reply in stops:
            if reply.set_running_or_notify_cancel():
                reply.set_result(None)

    def _land_checkpoints(self) -> None:
        """Run the pending turn-end steps, so the engine is left with nothing in flight.

        Each finished request computes its last token once more to publish its checkpoint (one
        step); the bound only stops an engine that keeps failing.
        """
        for _ in range(_MAX_CLOSING_STEPS):
            if not self.engine.scheduler.num_finalizing():
                return
            try:
                self.engine.step()
            except Exception:
                logger.exception("engine loop: a closing step failed; turn-end checkpoints are lost")
                return


def _refuse(command: Command) -> None:
    if command.reply.set_running_or_notify_cancel():
        command.reply.set_exception(EngineError("engine loop: it stopped before running this command"))
