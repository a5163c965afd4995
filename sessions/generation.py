"""``Generation``: one engine request driven to its end, streamed as text deltas, then settled.

A generation runs as its own asyncio task, independent of whoever consumes it: a non-streamed
append whose client went away still completes and commits, and a stream's consumer can only stop
it through ``cancel``. Its life::

    engine.generate(prompt) ──▶ tokens ──▶ IncrementalDetokenizer ──▶ OutputDelta queue
           │ (stop string: abort)                                 │
           ▼                                                      ▼
    Completion(output_ids, text, finish_reason) ──▶ settle() ──▶ GenerationResult (or an error)

``settle`` is the owner's hook: a session commits the turn there (atomically, with pin and
journal), a stateless completion just reports. An append without generation is a
``Generation`` too (no engine request, ``finish_reason`` None), so every append has one shape.

Cancel semantics: ``cancel()`` aborts the engine request; the engine's final output carries every
token generated so far, which become the last deltas and the committed output, with
``finish_reason == "cancelled"`` (unless the request had already finished on its own).
``cancel(discard=True)`` (a deleted session) ends the generation with ``SessionNotFound``
instead, and ``settle`` is not called. Engine failures end it with ``GenerationFailed``.

Room in the engine (``GenerationHooks``): ``prepare`` runs before the request (a spilled session
reads its state back from host or disk; the engine loads it into the GPU as it admits the
request, in its place in the queue). While the request waits for its first token, the engine is asked every
``_POLL_S`` whether it waits *for memory* (its pools are full after eviction), not merely for its
turn behind other work; once it has waited for memory ``stall_s``, ``relieve`` is called (demote
pinned sessions), again every ``stall_s`` while it still waits and ``relieve`` finds something.
A request queued behind other prefills never demotes anyone. A request the engine turns away for
lack of room (finished at once, ``length``, no token) is sent again after ``relieve`` (or, with
nothing to demote, a moment's wait for running requests and hand-off holds to give memory back)
until ``stall_s`` has passed since the first refusal; then it is ``Overloaded``, never an empty
turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.engine import (
    CapacityExceeded, EngineError, GrammarSpec, InvalidRequest, MemoryWait, SamplingParams, TokenLogprob,
)
from phloem.sessions.errors import (
    ContextLengthExceeded, GenerationFailed, InvalidInput, Overloaded, SessionError,
    SessionNotFound,
)
from phloem.sessions.options import GenerateOptions
from phloem.sessions.text.output_parser import OutputFormat, OutputParser, ParsedDelta, ParsedOutput
from phloem.sessions.session import FinishReason
from phloem.sessions.text.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from phloem.runtime import EngineClient, PrefixState

__all__ = [
    "Completion", "GenerateOptions", "Generation", "GenerationHooks", "GenerationOutput",
    "GenerationResult", "OutputDelta", "Usage",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one generation: the whole context it saw, the cached part, and the output.

    ``shared_tokens``: of the cached part, the prompt tokens computed once for this request's
    ``n`` choices together (``SessionManager.complete``); 0 for a single generation.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    shared_tokens: int = 0


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """New output: tokens and their newly printable text (either may be empty, not both).

    ``logprobs``: one per token when asked for; ``parsed``: the text split into reasoning,
    content and tool calls when the generation has an ``OutputFormat``.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    parsed: ParsedDelta | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """What a generation produced, before its owner settled it."""

    output_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    parsed: ParsedOutput | None = None
    # Of the cached tokens, those a spilled state the request carried loaded (``prepare``,
    # ``carry``); 0 when the cache held that prefix itself.
    num_resumed_tokens: int = 0
    # Seconds from the generation's start: ``prepare`` done (a spilled state read back), and the
    # first token (None: none came). Their difference is the engine's queue and prefill.
    prepared_s: float = 0.0
    first_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A settled generation; ``turn``/``num_tokens`` are set for session appends, ``parsed``
    for generations with an ``OutputFormat``, ``logprobs`` when asked for."""

    output_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    usage: Usage
    turn: int | None = None
    num_tokens: int | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    parsed: ParsedOutput | None = None


Settle = Callable[[Completion], Awaitable[GenerationResult]]


@dataclass(frozen=True, slots=True)
class GenerationHooks:
    """What the owner of a generation runs around its engine request.

    Args:
        settle: Turns the ``Completion`` into the result (a session commits its turn there).
        on_exit: Called once with the generation when it is over, whatever the outcome. It gets
            the generation as an argument rather than closing over it: a closure would make
            generation -> hooks -> closure -> generation a reference cycle, which only the cyclic
            GC frees, a full collection (minutes apart on a busy server) later, with everything
            the generation held.
        prepare: Awaited before the request is sent; must not raise. It may return a spilled
            prefix of the prompt (a session's state back from host or disk), which the engine
            loads as it admits the request (``EngineClient.generate``'s ``resume``); None: nothing
            to load.
        relieve: Awaited when the engine has no room for the request; frees some (demotes
            pinned sessions) and returns whether it found anything to free.
        stall_s: Seconds the request may wait for memory in the engine before ``relieve``;
            also how long a request the engine turns away for lack of room is sent again
            (relieving each time) before it is ``Overloaded``.
    """

    settle: Settle
    on_exit: Callable[[Generation], None]
    prepare: Callable[[], Awaitable[PrefixState | None]] | None = None
    relieve: Callable[[], Awaitable[bool]] | None = None
    stall_s: float = 5.0


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """How a generation's text is read (``format``) and constrained (``grammar``)."""

    format: OutputFormat
    grammar: GrammarSpec | None = None


class _NoRoom(Exception):
    """The engine finished the request at once without a token: its pools had no room."""


_END = object()
# How often a generation waiting for its first token asks the engine whether it waits for memory.
_POLL_S = 0.25
# How long a request turned away for lack of room, with nothing to demote, waits to be sent again.
_NO_ROOM_RETRY_S = 0.05
# The engine's reasons; "abort" only ever comes from our own cancel.
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "cancelled"}


class Generation:
    """One request to the engine (or none, for a plain append), run to its end on its own task.

    Args:
        engine: The engine client.
        tokenizer: Detokenizes the output.
        prompt_ids: The whole context to continue.
        options: Sampling options; None: no generation, only ``settle`` (e.g. an append of
            input alone). ``max_new_tokens`` must then be 0.
        max_new_tokens: Room left in the context window (>= 1 with ``options``).
        hooks: Settle, exit, prepare and relieve callbacks (``GenerationHooks``).
        output: How to split the text into reasoning, content and tool calls, and the grammar
            it must follow (``sessions.text.structured``); None: plain text.
        namespace: The prefix-cache namespace of the request: its owner (API key), so that it
            hits only that owner's cached prefixes and shared ones.
        hold_turn_end: The engine keeps the checkpoint at the request's end locked until the
            owner pins it (a session's turn: its new head, which memory pressure would otherwise
            evict between the request's end and the commit's pin; ``engine.cache.holds``).
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 options: GenerateOptions | None, max_new_tokens: int,
                 hooks: GenerationHooks, output: GenerationOutput | None = None, *,
                 namespace: str | None = None, hold_turn_end: bool = False) -> None:
        assert options is None or max_new_tokens >= 1, "a generation needs room for one token"
        self.request_id = f"gen-{uuid.uuid4().hex}"
        self._engine = engine
        self._tokenizer = tokenizer
        self._prompt_ids = list(prompt_ids)
        self._options = options
        self._max_new_tokens = max_new_tokens
        self._hooks = hooks
        self._output = output
        self._parser: OutputParser | None = None
        self._logprobs: list[TokenLogprob] = []
        self._namespace = namespace
        self._hold_turn_end = hold_turn_end
        self._resume: PrefixState | None = None  # what ``prepare`` returned, or ``carry`` gave
        self._num_resumed = 0  # of the prompt, the tokens ``_resume`` loaded (engine's report)
        self._in_engine = False  # its request was sent (and may be waiting for admission)
        self._admitted = False  # its first token came: the request runs
        self._hopeless = False  # aborted by the watchdog: nothing could make room for it
        self._created = time.monotonic()
        self._prepared_s = 0.0  # ``Completion.prepared_s``
        self._first_token_s: float | None = None
        self._events: asyncio.Queue[OutputDelta | object] = asyncio.Queue()
        self._result: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._cancelled = False
        self._discard = False
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[object]] = set()

    def start(self) -> None:
        """Start the driving task (once)."""
        assert self._task is None, "Generation.start called twice"
        self._task = asyncio.get_running_loop().create_task(self._drive(), name=self.request_id)

    @property
    def done(self) -> bool:
        """The generation is over (settled or failed)."""
        return self._result.done()

    @property
    def succeeded(self) -> bool:
        """The generation is over and was settled (for a session: its turn is committed)."""
        return self._result.done() and self._result.exception() is None

    def cancel(self, *, discard: bool = False) -> None:
        """Stop generating; a no-op once the generation is over.

        Args:
            discard: Commit nothing and end with ``SessionNotFound`` (the session was deleted);
                otherwise the partial output is settled with ``finish_reason == "cancelled"``.
        """
        if self.done:
            return
        self._discard = self._discard or discard
        if self._cancelled:
            return
        self._cancelled = True
        if self._options is not None and self._task is not None:
            task = asyncio.get_running_loop().create_task(self._abort())
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)

    async def result(self) -> GenerationResult:
        """Wait for the settled result.

        Raises:
            SessionError: The generation failed (``GenerationFailed``), or its session was
                deleted (``SessionNotFound``); nothing was committed.
        """
        return await asyncio.shield(self._result)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        """Yield the output as it comes (one consumer); ends when the output is complete.

        ``result()`` then returns the settled turn, or raises why it failed.
        """
        while True:
            item = await self._events.get()
            if item is _END:
                return
            assert isinstance(item, OutputDelta)
            yield item

    async def _abort(self) -> None:
        try:
            await self._engine.abort(self.request_id)
        except EngineError:
            logger.warning("abort of %s failed: the engine loop is not running", self.request_id)

    async def _drive(self) -> None:
        try:
            completion = await self._run()
            if self._discard:
                raise SessionNotFound("the session was deleted during its generation")
            result = await self._hooks.settle(completion)
        except SessionError as exc:
            self._result.set_exception(exc)
        except Exception as exc:
            logger.exception("generation %s failed", self.request_id)
            self._result.set_exception(GenerationFailed(f"generation failed: {exc!r}"))
        except asyncio.CancelledError:
            self._result.set_exception(GenerationFailed("the server is shutting down"))
            raise
        else:
            self._result.set_result(result)
        finally:
            if self._result.done() and not self._result.cancelled():
                # Mark a failure as seen: its consumer may be gone (asyncio would warn at GC).
                self._result.exception()
            self._events.put_nowait(_END)
            self._resume = None
            self._hooks.on_exit(self)

    async def _run(self) -> Completion:
        if self._options is None:
            cached = await self._engine.cached_prefix_len(self._prompt_ids, self._namespace)
            return Completion((), "", None, len(self._prompt_ids), cached)
        if self._hooks.prepare is not None and not self._cancelled:
            prepared = await self._hooks.prepare()
            if prepared is not None:  # else keep what ``carry`` may have given meanwhile
                self._resume = prepared
        self._prepared_s = time.monotonic() - self._created
        detok = self._tokenizer.detokenizer(self._options.stop)
        fmt = self._output.format if self._output is not None else None
        self._parser = OutputParser(fmt) if fmt is not None else None
        output: list[int] = []
        reason: str | None = "abort" if self._cancelled else None
        cached = 0
        if reason is None:
            grammar = self._output.grammar if self._output is not None else None
            params = self._options.sampling_params(self._max_new_tokens, grammar)
            reason, cached = await self._request_until_admitted(params, detok, output)
        tail = detok.finish()
        parsed = self._parse(tail, final=True)
        if tail or parsed:
            self._events.put_nowait(OutputDelta(tail, (), (), parsed))
        return Completion(tuple(output), detok.text, _FINISH_REASONS[reason or "abort"],
                          len(self._prompt_ids), cached, tuple(self._logprobs),
                          self._parser.result() if self._parser is not None else None,
                          self._num_resumed, self._prepared_s, self._first_token_s)

    def _parse(self, text: str, final: bool = False) -> ParsedDelta | None:
        """What ``text`` adds to the parts; ``final``: it is the detokenizer's tail, the last."""
        if self._parser is None:
            return None
        pushed = self._parser.push(text)
        if not final:
            return pushed
        rest = self._parser.finish()
        return ParsedDelta(pushed.reasoning + rest.reasoning, pushed.content + rest.content,
                           pushed.tool_calls + rest.tool_calls)

    async def _request_until_admitted(self, params: SamplingParams, detok: IncrementalDetokenizer,
                                      output: list[int]) -> tuple[str | None, int]:
        """``_request``, sent again while the engine turns it away for lack of room: each time
        the owner relieves memory first (demotes pinned sessions) or, with nothing to demote,
        waits a moment for running requests and hand-off holds to give some back; after
        ``stall_s`` from the first refusal it is ``Overloaded`` (the client retries later). The
        time a request queued behind other work before its refusal does not count: under load a
        request may queue for seconds, then find the pool pinned; it still gets its ``stall_s``
        of demotions."""
        deadline: float | None = None
        while True:
            try:
                return await self._request(params, detok, output)
            except _NoRoom:
                now = time.monotonic()
                deadline = now + self._hooks.stall_s if deadline is None else deadline
                if now >= deadline:
                    raise Overloaded("the engine has no room for this request now") from None
                if self._hooks.relieve is None or not await self._hooks.relieve():
                    await asyncio.sleep(_NO_ROOM_RETRY_S)

    async def _request(self, params: SamplingParams, detok: IncrementalDetokenizer,
                       output: list[int]) -> tuple[str | None, int]:
        """Run one engine request; return its finish reason and cached-token count.

        Raises:
            _NoRoom: The engine finished it at once without a token.
        """
        self._in_engine = True
        stream = self._engine.generate(self._prompt_ids, params, self.request_id, namespace=self._namespace,
                                       hold_turn_end=self._hold_turn_end, resume=self._resume)
        started = asyncio.Event()
        watchdog = asyncio.get_running_loop().create_task(self._watch_admission(started))
        reason: str | None = None
        cached = 0
        try:
            async for out in stream:
                if out.finished and out.finish_reason == "length" and not out.token_ids:
                    raise _NoRoom
                if out.finished and not out.token_ids and self._hopeless:
                    raise Overloaded("the engine has no room for this request now")
                started.set()
                if self._first_token_s is None and out.new_token_ids:
                    self._first_token_s = time.monotonic() - self._created
                self._admitted = True
                # Loaded (or found in the cache): a spilled state is tensors of the session's
                # whole history, host memory the engine no longer needs from us.
                self._resume = None
                cached, self._num_resumed = out.num_cached_tokens, out.num_resumed_tokens
                reason = self._consume(out.new_token_ids, out.finish_reason, detok, output,
                                       out.new_logprobs or ())
                if reason is not None:
                    break
        except InvalidRequest as exc:
            raise InvalidInput(str(exc)) from exc
        except CapacityExceeded as exc:
            raise ContextLengthExceeded(str(exc)) from exc
        except EngineError as exc:
            raise GenerationFailed(f"the engine failed: {exc}") from exc
        finally:
            watchdog.cancel()
            # Leaving early (stop string) aborts the engine request.
            with contextlib.suppress(EngineError):
                await stream.aclose()
        return reason, cached

    @property
    def waiting(self) -> bool:
        """Not admitted yet: no token so far, and not finished."""
        return not self._admitted and not self._result.done()

    async def carry(self, state: PrefixState) -> bool:
        """Take a spilled state of a prefix of the prompt, for the request to load as the engine
        admits it: the session let go of the pin that held that prefix so that the requests this
        one waits behind can run (``Spiller.relieve``). False once the request runs (too late:
        the session keeps its pin) or the engine does not take it."""
        if not self.waiting:
            return False
        self._resume = state  # a request sent again (turned away for room) carries it too
        if not self._in_engine:
            return True
        try:
            return await self._engine.attach_resume(self.request_id, state)
        except EngineError:
            return False

    async def _watch_admission(self, started: asyncio.Event) -> None:
        """Until the first token: call ``relieve`` once the request has waited ``stall_s`` for
        memory in the engine, and again every ``stall_s`` while it waits and ``relieve`` finds
        something to free. When nothing runs in the engine (``MemoryWait.STALLED``: no request
        will give memory back, only unpinning frees it) ``relieve`` is called at once; if it
        still finds nothing to free ``stall_s`` later, the request is aborted and the generation
        is ``Overloaded`` (what holds the memory is pinned for good, e.g. shared prefixes)."""
        relieve = self._hooks.relieve
        if relieve is None:
            return
        blocked_since: float | None = None
        hopeless_since: float | None = None  # stalled, with nothing to relieve
        loop = asyncio.get_running_loop()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(started.wait(), _POLL_S)
                return
            try:
                short = await self._engine.waits_for_memory(self.request_id)
            except EngineError:
                return
            now = loop.time()
            if not short:
                blocked_since = None
                continue
            blocked_since = now if blocked_since is None else blocked_since
            if now - blocked_since < self._hooks.stall_s and short is not MemoryWait.STALLED:
                continue
            logger.info("generation %s has waited %.1f s for memory in the engine; demoting pinned sessions",
                        self.request_id, now - blocked_since)
            blocked_since = None
            # Shielded: a demotion in progress completes even when the first token arrives.
            if await asyncio.shield(relieve()):
                hopeless_since = None
            elif short is not MemoryWait.STALLED:
                return
            else:
                hopeless_since = now if hopeless_since is None else hopeless_since
                if now - hopeless_since >= self._hooks.stall_s:
                    self._hopeless = True
                    with contextlib.suppress(EngineError):
                        await self._engine.abort(self.request_id)
                    return

    def _consume(self, new_ids: Sequence[int], engine_reason: str | None,
                 detok: IncrementalDetokenizer, output: list[int],
                 logprobs: Sequence[TokenLogprob]) -> str | None:
        """Feed one engine output to the detokenizer; return the finish reason if it ended."""
        text, ids = [], []
        for token in new_ids:
            output.append(token)
            ids.append(token)
            text.append(detok.push(token))
            if detok.stopped:
                break
        kept = tuple(logprobs[:len(ids)])
        self._logprobs.extend(kept)
        joined = "".join(text)
        if ids or joined:
            self._events.put_nowait(OutputDelta(joined, tuple(ids), kept, self._parse(joined)))
        return "stop" if detok.stopped else engine_reason
