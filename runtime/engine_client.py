"""The asyncio face of the engine: coroutines and async iterators over the engine loop thread.

    client = EngineClient.from_pretrained(path, EngineConfig(load=LoadConfig(device="cuda")))
    client.start()
    async for out in client.generate(prompt_ids, SamplingParams(max_tokens=64)):
        send(out.new_token_ids)          # the last item has out.finished == True
    await client.shutdown()

Nothing here blocks the event loop: every call is a command to ``EngineLoop`` whose reply future
is awaited through ``asyncio.wrap_future``, and a request's outputs come back through an
``asyncio.Queue`` fed with ``call_soon_threadsafe``.

A generation whose consumer stops early (``aclose()``, a cancelled task, a client that went away,
or an exception in the ``async for`` body) is aborted in the engine, so its pages and slots are
freed. The abort names the generation's own output sink, so it can never hit another request
that reuses the id. Cancelling any other call before the engine thread picked it up means the
command is skipped.

A request with a grammar waits for its compile first (``runtime.grammar_compiles``: a pool of
its own, fair per owner, within a time budget), before anything reaches the engine. Aborting it
then (``abort``, or cancelling its consumer) stops the wait: the request never reaches the
engine, and its compile, if still queued and wanted by no other request, never starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Protocol, TypeVar

from phloem.engine import (
    Engine, EngineError, GrammarSpec, GrammarStats, InvalidRequest, MemoryWait, RequestOutput, SamplingParams,
    WarmupReport,
)
from phloem.engine.config import EngineConfig, ModelConfig
from phloem.runtime.engine_commands import (
    AbortRequest,
    AddRequest,
    Command,
    EngineStats,
    ExportPrefix,
    GetStats,
    HostAlloc,
    ImportPrefix,
    OutputSink,
    PinPrefix,
    PrefixHandle,
    PrefixState,
    QueryCachedPrefix,
    QueryWaitsForMemory,
    AttachResume,
    ResetPrefixCache,
    UnpinPrefix,
)
from phloem.runtime.engine_loop import EngineLoop
from phloem.runtime.grammar_compiles import GrammarCompiles
from phloem.runtime.env import use_nccl_defaults

__all__ = ["EngineClient"]

T = TypeVar("T")


class _Query(Protocol[T]):
    """A command whose reply future resolves to ``T``."""

    @property
    def reply(self) -> Future[T]: ...


class EngineClient:
    """Asyncio facade of one engine running on its own thread.

    Args:
        engine: The engine to own. After ``start`` only the loop thread touches it; after
            ``shutdown`` returns it may be inspected again (``shutdown`` closes it: a
            tensor-parallel engine's worker processes are stopped, so it no longer steps).
    """

    def __init__(self, engine: Engine) -> None:
        self._loop = EngineLoop(engine)
        # Thread-safe: grammars compile on their own pool, off the event loop and the engine thread.
        self._grammar = engine.grammar
        self._compiles = GrammarCompiles(engine.grammar) if engine.grammar is not None else None
        self._compiling: dict[str, asyncio.Future[object]] = {}  # request id -> its grammar's compile
        self._model_config = engine.model_config
        self._max_model_len = engine.max_model_len

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> EngineClient:
        """Load a model folder into a new engine (blocking; call before serving). Not started.

        Args:
            path: A Hugging Face model folder.
            config: The engine's configuration; None: ``EngineConfig()``.

        Returns:
            The client; call ``start`` before using it.

        Raises:
            ValueError: The folder or an option is invalid (from the engine's loader and configs).
        """
        use_nccl_defaults()  # before any NCCL group forms (tensor parallelism on GPUs)
        return cls(Engine.from_pretrained(path, config))

    @property
    def model_config(self) -> ModelConfig:
        """The served model's config (vocab_size, eos_token_ids, ...); immutable."""
        return self._model_config

    @property
    def max_model_len(self) -> int:
        """The longest token history a request may reach (prompt + output)."""
        return self._max_model_len

    @property
    def is_running(self) -> bool:
        return self._loop.is_running

    def warm_up(self, show_progress: bool | None = None) -> WarmupReport:
        """Run every kind of step serving uses once, so its kernels compile now, not in a first
        request (``Engine.warm_up``); blocking, before ``start``.

        Args:
            show_progress: A bar over the warm-up requests: False never, None on a terminal.

        Returns:
            What ran.

        Raises:
            RuntimeError: The engine thread runs already.
        """
        if self.is_running:
            raise RuntimeError("warm_up: call it before start()")
        return self._loop.engine.warm_up(show_progress)

    def start(self) -> None:
        """Start the engine thread.

        Raises:
            RuntimeError: It was started before.
        """
        self._loop.start()

    async def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort every generation in flight (each raises ``EngineError``), stop the thread, then
        close the engine (stopping its tensor-parallel worker processes, if any).

        Args:
            timeout: Seconds to wait for the thread (a step in progress finishes first).

        Raises:
            TimeoutError: The thread did not stop in time (the engine is left open).
        """
        if self._compiles is not None:
            self._compiles.close()
        # A thread of its own, not the default pool: nothing queued there can delay the stop.
        done: Future[None] = Future()

        def stop() -> None:
            try:
                self._stop(timeout)
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=stop, name="phloem-engine-shutdown", daemon=True).start()
        await asyncio.wrap_future(done)

    def _stop(self, timeout: float | None) -> None:
        self._loop.shutdown(timeout)
        self._loop.engine.close()

    async def __aenter__(self) -> EngineClient:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.shutdown()

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        prefill_only: bool = False,
        namespace: str | None = None,
        hold_turn_end: bool = False,
        resume: PrefixState | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate from ``prompt_token_ids``, yielding an output per engine step that produced tokens.

        Each item's ``new_token_ids`` are that step's tokens; concatenated they equal the final
        item's ``token_ids``. The final item has ``finished=True`` and a ``finish_reason`` of
        ``"stop"``, ``"length"`` or (after ``abort``) ``"abort"``.

        Args:
            prompt_token_ids: The full token history to continue (the prefix cache finds what
                is already computed).
            params: Sampling parameters.
            request_id: The engine request id; None: a fresh unique id. Use it with ``abort``.
            output_token_ids: Tokens already generated for this prompt elsewhere (a
                disaggregated prefill's first token): the request continues after them, and
                the outputs' ``token_ids`` include them.
            prefill_only: Compute the prompt and publish it in the prefix cache, generating
                nothing: the one output has ``finish_reason == "prefill"`` (requests that
                share the prompt then find all of it cached: ``n`` choices of one prompt).
            namespace: The prefix-cache namespace (tenant) it matches and publishes in; None:
                the shared one (``engine.cache.radix``).
            hold_turn_end: Keep the checkpoint published at its end locked until ``pin_prefix``
                pins it (or ``CacheConfig.handoff_hold_s`` passes): a session's turn, whose
                new head memory pressure must not evict before the session pins it.
            resume: A spilled prefix of the prompt (``export_prefix``'s state, back from a
                session tier): loaded into the prefix cache when the engine admits the request,
                in its place in the queue, unless the cache holds that prefix by then; ignored
                when it is not a prefix of the prompt (the request then computes it).

        Yields:
            RequestOutput items, the last one finished.

        Raises:
            InvalidRequest: Bad prompt or params (a grammar that does not compile included), or
                a request id already in flight (raised by the first ``__anext__``, before
                anything is yielded).
            CapacityExceeded: The prompt cannot fit the engine's pools even when empty.
            EngineError: The engine loop is not running, or a step failed or the loop shut down
                while this request was in flight.
        """
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        prompt, outputs = tuple(prompt_token_ids), tuple(output_token_ids)

        def add(sink: OutputSink) -> AddRequest:
            return AddRequest(prompt, params, request_id, sink, outputs, namespace, prefill_only, hold_turn_end,
                              resume)

        return self._outputs(request_id, add, params.grammar, namespace)

    async def prefill(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """Compute ``token_ids`` and publish a checkpoint at their end in the prefix cache's
        ``namespace``, sampling nothing (an operator's shared prefix, before it is pinned).

        Returns:
            How many of the tokens were already cached.

        Raises:
            InvalidRequest, CapacityExceeded, EngineError: As ``generate``.
        """
        request_id = f"prefill-{uuid.uuid4().hex}"

        def add(sink: OutputSink) -> AddRequest:
            return AddRequest(tuple(token_ids), SamplingParams(max_tokens=1), request_id, sink,
                              namespace=namespace, prefill_only=True)

        cached = 0
        stream = self._outputs(request_id, add)
        async with contextlib.aclosing(stream):
            async for out in stream:
                cached = out.num_cached_tokens
        return cached

    async def _outputs(
        self, request_id: str, make: Callable[[OutputSink], AddRequest], grammar: GrammarSpec | None = None,
        owner: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit the request ``make(sink)`` builds (its ``grammar`` compiled first, off the event
        loop, on ``owner``'s share of the compile pool); yield its outputs; abort it if left early."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()

        def sink(item: RequestOutput | EngineError) -> None:
            # Engine thread: hand over and return at once (raises if the event loop closed).
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        held: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if grammar is not None:
            # A task of its own, so that ``abort`` can stop the wait (a cancelled generation
            # whose compile is still queued drops it, and never reaches the engine).
            compiling = asyncio.ensure_future(self._compile(grammar, owner))
            self._compiling[request_id] = compiling
            try:
                compiled = await compiling
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not compiling.cancelled() or (task is not None and task.cancelling()):
                    raise  # this task itself is cancelled (compiling was, with it)
                yield RequestOutput(request_id, [], [], [], True, "abort", 0)  # ``abort`` came first
                return
            finally:
                if self._compiling.get(request_id) is compiling:
                    del self._compiling[request_id]
            held = self._grammar.hold(grammar, compiled)  # type: ignore[union-attr]
        add = make(sink)
        done = False
        try:
            with held:  # until the engine made the request's matcher
                self._loop.submit(add)
                await asyncio.wrap_future(add.reply)
            while not done:
                item = await outputs.get()
                if isinstance(item, EngineError):
                    done = True  # the loop already dropped the request
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                # Fire and forget: a cancelled task cannot await, and the queue is FIFO, so this
                # lands after the AddRequest. A no-op if the add failed or was skipped.
                self._submit_quietly(AbortRequest(request_id, sink))

    async def compile_grammar(self, grammar: GrammarSpec, owner: str | None = None) -> None:
        """Compile ``grammar`` on the compile pool (``runtime.grammar_compiles``; cached: the
        engine's matcher then starts at once), to check it before a request uses it.

        Args:
            grammar: The grammar.
            owner: Whose compile concurrency and cache quota it counts against (the API key).

        Raises:
            InvalidRequest: past a limit, xgrammar rejects it, not compiled within the budget,
                or the engine has no tokenizer to compile with.
        """
        await self._compile(grammar, owner)

    async def _compile(self, grammar: GrammarSpec, owner: str | None) -> object:
        if self._compiles is None:
            raise InvalidRequest("grammar: this engine was built without a tokenizer to compile grammars with")
        return await self._compiles.compile(grammar, owner)

    def grammar_stats(self) -> GrammarStats | None:
        """The grammar cache's and compile pool's counters (None: no grammar backend); cheap,
        never waits for the engine thread."""
        if self._grammar is None or self._compiles is None:
            return None
        return self._compiles.stats(self._grammar.stats())

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its generator then yields a final ``"abort"`` output.

        Args:
            request_id: The id given to (or generated by) ``generate``.

        Returns:
            True if the request was in flight, False if unknown or already finished.

        Raises:
            EngineError: The engine loop is not running.
        """
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:  # still waiting for its grammar: stop the wait, submit nothing
            compiling.cancel()
            return True
        return await self._call(AbortRequest(request_id))

    async def pin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> PrefixHandle | None:
        """Pin the deepest cached checkpoint within ``token_ids`` against eviction.

        Args:
            token_ids: A token history (e.g. a session's tokens).
            namespace: The prefix-cache namespace it was cached in (None: the shared one).

        Returns:
            An opaque handle for ``unpin_prefix``, or None when nothing of it is cached.

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(PinPrefix(tuple(token_ids), namespace))

    async def unpin_prefix(self, handle: PrefixHandle) -> None:
        """Release a pin taken by ``pin_prefix`` (exactly once per handle).

        Raises:
            EngineError: The engine loop is not running.
        """
        await self._call(UnpinPrefix(handle))

    async def cached_prefix_len(self, token_ids: Sequence[int], namespace: str | None = None,
                                *, settled: bool = True) -> int:
        """How many leading tokens of ``token_ids`` a new request in ``namespace`` would take
        from the cache. ``settled``: wait until the turn-end checkpoints of requests that just
        finished have landed (the next step, if any is finalizing); False: answer between the
        current steps (for a prefix no request is finishing, such as a spilled session's).

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(QueryCachedPrefix(tuple(token_ids), namespace, settled))

    async def attach_resume(self, request_id: str, state: PrefixState) -> bool:
        """Give a request still waiting for admission a spilled prefix of its prompt to load as
        it is admitted (``generate``'s ``resume``). False when it runs already, or is unknown.

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(AttachResume(request_id, state))

    async def waits_for_memory(self, request_id: str) -> MemoryWait:
        """Whether the request waits because the engine has no memory for it now (its pools are
        full after eviction), rather than for its turn behind other work; ``STALLED`` when
        nothing runs either (only unpinning frees memory then).

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(QueryWaitsForMemory(request_id))

    async def export_prefix(self, token_ids: Sequence[int], namespace: str | None = None,
                            host_alloc: HostAlloc | None = None) -> PrefixState | None:
        """Host copies of the KV pages and GDN checkpoint of the deepest cached prefix of
        ``token_ids`` (to spill a session); the device copy stays in the cache.

        A turn-end checkpoint still being published is waited for, as in ``pin_prefix``.

        Args:
            token_ids: A token history (e.g. a session's tokens).
            namespace: The prefix-cache namespace it was cached in (None: the shared one).
            host_alloc: Gives the copies' host memory where it can (``storage.PinnedArena.alloc``:
                memory pinned once, so the engine thread does not pin for each spill).

        Returns:
            The state, covering ``state.token_ids`` (a prefix of ``token_ids``), or None when
            nothing of it is cached (and always under tensor parallelism, for now).

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(ExportPrefix(tuple(token_ids), namespace, host_alloc))

    async def import_prefix(self, state: PrefixState, namespace: str | None = None) -> bool:
        """Load a spilled prefix into fresh pages and a fresh slot and publish it in the prefix
        cache, so the next request on that history computes only what lies past it.

        Args:
            state: What ``export_prefix`` returned (possibly after a round trip through storage).
            namespace: The prefix-cache namespace to publish it in (None: the shared one).

        Returns:
            False when the pools could not make room (nothing was taken).

        Raises:
            ValueError: The tensors do not match this engine's cache layout.
            EngineError: The engine loop is not running.
        """
        return await self._call(ImportPrefix(state, namespace))

    async def reset_prefix_cache(self) -> None:
        """Drop every unpinned prefix from the cache (pinned heads and running requests stay).

        Raises:
            EngineError: The engine loop is not running.
        """
        await self._call(ResetPrefixCache())

    async def stats(self) -> EngineStats:
        """Pool and cache counters, taken between two engine steps.

        Raises:
            EngineError: The engine loop is not running.
        """
        return await self._call(GetStats())

    async def stats_or_none(self, timeout_s: float) -> EngineStats | None:
        """``stats()``, or None when the loop is not running or does not answer within
        ``timeout_s`` (a step that runs long): for monitoring, which must never fail.

        Args:
            timeout_s: Seconds to wait for the engine thread.
        """
        try:
            return await asyncio.wait_for(self.stats(), timeout_s)
        except (EngineError, TimeoutError):
            return None

    async def _call(self, command: _Query[T]) -> T:
        self._loop.submit(command)  # type: ignore[arg-type]
        return await asyncio.wrap_future(command.reply)

    def _submit_quietly(self, command: Command) -> None:
        try:
            self._loop.submit(command)
        except EngineError:
            pass  # the loop stopped, and shutting down aborted every request already
