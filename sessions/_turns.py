"""Running appends and stateless completions: admission, the busy flag, and the atomic commit.

``TurnRunner`` starts a ``Generation`` for a session append (or for a stateless completion)
and settles it:

- admission: at most ``max_num_generations`` generations in flight (plain appends without
  generation are not counted), none once closing (``Overloaded``);
- one append per session: ``session.busy`` is checked and set with no ``await`` in between, so
  two appends racing on one event loop cannot both pass;
- the commit (``_commit``): under ``session.lock``, the new turn (input + output) is written to
  the store first and only then applied in memory, then the new head is pinned. A failed write,
  a failed generation or a deleted session commits nothing; a cancelled one commits its partial
  output (``finish_reason == "cancelled"``);
- room in the engine: a session's request first resumes its spilled state
  (``Spiller.resume``); every request may demote pinned sessions when it stalls for room
  (``Spiller.relieve``, see ``sessions.tiers.spill``);
- ``n`` choices of one completion are ``n`` generations that share one prefill of their prompt
  (``sessions._prefill``) and count ``n`` against the admission limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phloem.sessions._events import SessionEvents
from phloem.sessions._inputs import ResolvedInput, check_context, check_token_ids
from phloem.sessions.tiers._pins import PinKeeper
from phloem.sessions.config import SessionConfig
from phloem.sessions.errors import Overloaded, SessionBusy, SessionNotFound
from phloem.sessions._prefill import SharedPrefill
from phloem.sessions.generation import (
    Completion, GenerateOptions, Generation, GenerationHooks, GenerationOutput, GenerationResult,
    Usage,
)
from phloem.sessions.session import Session, Turn
from phloem.sessions.tiers.store import SessionStore
from phloem.sessions.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from phloem.runtime import EngineClient, PrefixState
    from phloem.sessions.tiers.spill import Spiller

__all__ = ["TurnRunner"]


class TurnRunner:
    """Starts and settles generations (see the module docstring).

    Args:
        engine: The engine client.
        tokenizer: The model's tokenizer.
        store: Where committed turns are written.
        pins: Pins each new head.
        config: Admission limits.
        spill: Resumes spilled sessions and demotes pinned ones when the engine is full.
        events: Logs and counts every finished generation.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, store: SessionStore,
                 pins: PinKeeper, config: SessionConfig, spill: Spiller,
                 events: SessionEvents) -> None:
        self._engine = engine
        self._events = events
        self._tokenizer = tokenizer
        self._store = store
        self._pins = pins
        self._config = config
        self._spill = spill
        self._generations: set[Generation] = set()
        self.closing = False

    @property
    def num_in_flight(self) -> int:
        """Generations started and not yet settled."""
        return len(self._generations)

    def check_open(self) -> None:
        """Raise ``Overloaded`` once closing."""
        if self.closing:
            raise Overloaded("the server is shutting down", self._config.retry_after_s)

    @staticmethod
    def check_idle(session: Session) -> None:
        """Raise ``SessionBusy`` while an append runs on ``session``."""
        if session.busy:
            raise SessionBusy(f"session {session.session_id} is generating (turn "
                              f"{len(session.turns)}); retry after its done")

    def _check_options(self, options: GenerateOptions) -> None:
        """Raise ``InvalidInput`` for a stop token id outside the vocabulary."""
        check_token_ids(options.stop_token_ids, self._engine.model_config.vocab_size, "stop_token_ids")

    def admit(self, n: int = 1) -> None:
        """Raise ``Overloaded`` unless ``n`` more generations may start."""
        self.check_open()
        if len(self._generations) + n > self._config.max_num_generations:
            raise Overloaded(f"{len(self._generations)} generations are in flight, the most this "
                             "server runs at once", self._config.retry_after_s)

    def append(self, session: Session, new: ResolvedInput, generate: GenerateOptions | None,
               output: GenerationOutput | None = None, view: str | None = None) -> Generation:
        """Start an append on ``session`` (input already resolved against its context); its
        output is read (and constrained) as ``output`` says; ``view`` is stored with its turn.

        Raises:
            SessionBusy: Another append runs on the session.
            ContextLengthExceeded / InvalidInput: The result would not fit, or nothing to
                continue.
            Overloaded: Too many generations in flight, or closing.
        """
        self.check_idle(session)
        if generate is not None:
            self._check_options(generate)
            self.admit()
        self.check_open()
        prompt = session.token_ids + new.token_ids
        room = check_context(len(prompt), self._engine.max_model_len, generate is not None)
        status_before, session.status, session.busy = session.status, "active", True
        # Already sent and computed: up to the end of the last generated turn (tokens appended
        # without generation since were never computed, so no cache could serve them).
        history_len = next((t.end for t in reversed(session.turns) if t.finish_reason is not None), 0)
        started = time.monotonic()

        async def settle(completion: Completion) -> GenerationResult:
            result = await self._commit(session, new, completion, view)
            if result.finish_reason is not None:
                self._spill.count_carried(session, completion.num_resumed_tokens)
                resumed, session.resumed = session.resumed, None
                self._events.served.turn(history_len, result.usage.cached_tokens, resumed)
            self._finished(session.session_id, result, started, completion)
            return result

        def on_exit(generation: Generation) -> None:
            session.busy, session.generation, session.carried = False, None, None
            if not generation.succeeded and not session.deleted:
                # A turn that let go of its pin while it waited (``Spiller._step_aside``) left
                # its state on host, or only in the prefix cache.
                session.status = status_before if session.pin is not None or status_before != "active" \
                    else "host" if session.segment is not None else "idle"
            self._generations.discard(generation)

        async def prepare() -> PrefixState | None:
            return await self._spill.state_for_append(session)

        async def relieve() -> bool:
            return await self._spill.relieve(exclude=session)

        hooks = GenerationHooks(settle, on_exit, prepare, relieve, self._config.admission_stall_s)
        generation = Generation(self._engine, self._tokenizer, prompt, generate,
                                room if generate is not None else 0, hooks, output, namespace=session.owner,
                                hold_turn_end=True)
        session.generation = generation
        if generate is not None:
            self._generations.add(generation)
        generation.start()
        return generation

    def complete(self, prompt_ids: Sequence[int], options: GenerateOptions, n: int = 1,
                 output: GenerationOutput | None = None, owner: str | None = None) -> list[Generation]:
        """Start ``n`` stateless generations of one prompt for ``owner`` (see
        ``SessionManager.complete``)."""
        self._check_options(options)
        self.admit(n)
        check_token_ids(prompt_ids, self._engine.model_config.vocab_size, "prompt")
        room = check_context(len(prompt_ids), self._engine.max_model_len, generate=True)
        share = SharedPrefill(self._engine, prompt_ids, owner) if n > 1 and len(prompt_ids) > 1 else None
        # Choice i of a seeded request draws from seed + i: reproducible, and the choices differ.
        seeds = [None if options.seed is None else (options.seed + i) % 2**63 for i in range(n)]
        return [self._completion(prompt_ids, dataclasses.replace(options, seed=seed), room, share, output, owner)
                for seed in seeds]

    def _completion(self, prompt_ids: Sequence[int], options: GenerateOptions, room: int,
                    share: SharedPrefill | None, output: GenerationOutput | None, owner: str | None) -> Generation:
        started = time.monotonic()

        async def settle(c: Completion) -> GenerationResult:
            shared = max(0, c.num_cached_tokens - share.num_cached_tokens) if share is not None else 0
            usage = Usage(c.num_prompt_tokens, c.num_cached_tokens, len(c.output_ids), shared)
            result = GenerationResult(c.output_ids, c.text, c.finish_reason, usage,
                                      logprobs=c.logprobs, parsed=c.parsed)
            self._finished(None, result, started, c)
            return result

        hooks = GenerationHooks(settle, self._generations.discard,
                                prepare=share.wait if share is not None else None,
                                relieve=self._spill.relieve,
                                stall_s=self._config.admission_stall_s)
        generation = Generation(self._engine, self._tokenizer, prompt_ids, options, room, hooks, output,
                                namespace=owner)
        self._generations.add(generation)
        generation.start()
        return generation

    async def close(self, timeout_s: float) -> None:
        """Refuse new work; cancel the generations in flight and wait for their commits."""
        self.closing = True
        pending = list(self._generations)
        for generation in pending:
            generation.cancel()
        if pending:
            await asyncio.wait([asyncio.ensure_future(g.result()) for g in pending], timeout=timeout_s)

    def _finished(self, session_id: str | None, result: GenerationResult, started: float,
                  completion: Completion) -> None:
        """Report a settled generation (an append without one computed nothing: not reported)."""
        if result.finish_reason is not None:
            self._events.generation_finished(session_id, result.turn, result.finish_reason,
                                             result.usage, time.monotonic() - started,
                                             completion.prepared_s, completion.first_token_s)

    async def replace_view(self, session: Session, index: int, view: str | None) -> None:
        """Replace the ``view`` of committed turn ``index`` (journal first, then memory).

        Raises:
            SessionNotFound: The session was deleted meanwhile.
            GenerationFailed: The record could not be written (nothing changed).
        """
        async with session.lock:
            if session.deleted:
                raise SessionNotFound(f"session {session.session_id} was deleted")
            turns = list(session.turns)
            turns[index] = dataclasses.replace(turns[index], view=view)
            await self._store.write(dataclasses.replace(session, turns=turns))
            session.turns = turns

    async def _commit(self, session: Session, new: ResolvedInput, completion: Completion,
                      view: str | None) -> GenerationResult:
        output = list(completion.output_ids)
        generated = completion.finish_reason is not None
        chat = new.chat.with_output(new.after_generation_prompt) if generated else new.chat
        async with session.lock:
            if session.deleted:
                raise SessionNotFound(f"session {session.session_id} was deleted")
            tokens = session.token_ids + new.token_ids + output
            calls = completion.parsed.tool_calls if completion.parsed is not None else ()
            turn = Turn(len(session.turns), len(session.token_ids), len(tokens), len(output),
                        completion.finish_reason, int(time.time()), len(chat.messages),
                        chat.open_output, calls, completion.num_cached_tokens, view)
            committed = dataclasses.replace(session, token_ids=tokens, turns=[*session.turns, turn],
                                            chat_messages=list(chat.messages))
            await self._store.write(committed)
            session.token_ids, session.turns = committed.token_ids, committed.turns
            session.chat_messages = committed.chat_messages
            await self._pins.activate(session)
        usage = Usage(completion.num_prompt_tokens, completion.num_cached_tokens, len(output))
        return GenerationResult(completion.output_ids, completion.text, completion.finish_reason,
                                usage, turn=turn.index, num_tokens=len(tokens),
                                logprobs=completion.logprobs, parsed=completion.parsed)
