"""``SessionManager``: sessions as first-class objects over one engine (docs/architecture.md, "Invariants").

Every operation is scoped by ``owner`` (the API key): a session of another owner does not exist.

- **create** commits the optional initial content as turn 0 and pins it. NOTE: the engine has a
  prefill-only request (``Engine.add_request(prefill_only=True)``, ``EngineClient.prefill``) but
  this layer does not use it yet, so input that is appended without a generation (turn 0, an
  append without ``generate``) is recorded but computed by the next generation, whose
  ``cached_tokens`` then reflect it. A generated turn ends with a checkpoint at its very end.
- **append** turns the input into tokens (``sessions.text.chat`` for messages), checks the context
  window, and runs a ``Generation`` from ``token_ids + new`` (or just commits the input). The
  turn (input + output) is committed atomically when it ends: journal first, then memory, then
  the new head is pinned (``sessions.tiers._pins``). One append runs per session at a time; another
  one meanwhile is ``SessionBusy``, also for appends without generation.
- **fork** copies the committed turns ``0..at_turn`` (token ids, turns, chat context) into ``n``
  children and pins their head: in the engine they share the parent's cached prefix
  (``sessions._forks``).
- **delete** cancels a generation in flight without committing it, unpins, and forgets the
  session in memory and on disk. **cancel** (``Generation.cancel``) commits the partial output.
- **complete** runs a stateless generation (the OpenAI-compatible routes), or ``n`` that share
  one prefill of their prompt, under the same admission limit (``max_num_generations``; beyond
  it, or while closing: ``Overloaded``).
- **structured output**: a generation's text is split into reasoning, content and tool calls
  (``sessions.text.output_parser``: the session's tools, or a completion's), and ``response_format``
  or a forced ``tool_choice`` becomes a grammar the engine enforces (``sessions.text.structured``);
  the grammar is compiled before the generation starts, so a schema the grammar engine rejects
  is ``InvalidInput`` and never a failed stream.
- **tiers** (``sessions.tiers.spill``): idle sessions are spilled to host memory, then disk, by a
  sweeper, or now by **offload**; an append or **prefetch** resumes them (both methods come
  from ``sessions.tiers._tier_moves``); a fork of a spilled session shares its segment. **start**
  brings back every journaled session (from its disk segment when there is one). The index is
  best effort: ``health`` says when it is degraded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phloem.sessions._events import SessionEvents, SessionStats
from phloem.sessions._forks import commit_children, make_children
from phloem.sessions._inputs import (
    ResolvedInput, SessionInput, check_context, check_input_size, resolve_input,
)
from phloem.sessions.tiers._io import DURABLE
from phloem.sessions.tiers._pins import PinKeeper
from phloem.sessions._shared_prefixes import share_prefixes
from phloem.sessions.text._tokenize_pool import TokenizePool
from phloem.sessions.tiers._tier_moves import TierMoves
from phloem.sessions._turns import TurnRunner
from phloem.sessions.config import KEEP, Keep, SessionConfig
from phloem.engine import InvalidRequest
from phloem.sessions.errors import GenerationFailed, InvalidInput, SessionBusy, SessionNotFound
from phloem.sessions.generation import GenerateOptions, Generation, GenerationOutput
from phloem.sessions.session import Session, SessionIdGenerator, SessionSnapshot, Turn, TurnInfo
from phloem.sessions.tiers.spill import Spiller
from phloem.sessions.tiers.store import SessionStore
from phloem.sessions.text.structured import build_grammar, output_format
from phloem.sessions.text.tokenizer import Message, Tokenizer, ToolSpec

if TYPE_CHECKING:
    from phloem.runtime import EngineClient

__all__ = ["KEEP", "SessionConfig", "SessionInput", "SessionManager"]

logger = logging.getLogger(__name__)


class SessionManager(TierMoves):
    """Creates, finds, appends to, forks and deletes sessions over one engine client.

    ``offload`` and ``prefetch`` come from the ``TierMoves`` mixin (``sessions.tiers._tier_moves``).

    Args:
        engine: A started engine client.
        tokenizer: The served model's tokenizer.
        config: The sessions layer's config (what the user chose).
        model_fingerprint: Identifies the served model (``store.model_fingerprint`` of its
            folder): measured by the caller, never configured; a journaled session of another
            model is not resumed.

    Raises:
        StorageError: The journal or the index cannot be opened.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, config: SessionConfig, *,
                 model_fingerprint: str) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._config = config
        self._store = SessionStore(config.data_dir, model_fingerprint, config.redis_url,
                                   config.redis_prefix)
        self._sessions: dict[str, Session] = {}
        self._new_id = SessionIdGenerator()
        self._pins = PinKeeper(engine)
        self._events = SessionEvents()
        self._spill = Spiller(engine, self._store, self._pins, config, self._sessions, self._events)
        self._turns = TurnRunner(engine, tokenizer, self._store, self._pins, config, self._spill,
                                 self._events)
        self._shared_pins: list[object] = []
        self._tokenize = TokenizePool(config.tokenize_workers, config.max_tokenizations_per_owner)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def config(self) -> SessionConfig:
        """The config it was built with."""
        return self._config

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    async def start(self) -> None:
        """Compute and pin the shared prefixes, load the journaled sessions (status ``disk``:
        resumed from their disk segment, if any, else by recompute, on their next append),
        refresh the index, start the sweeper.

        Raises:
            InvalidInput: A shared prefix does not render or fit the context window.
        """
        self._shared_pins = await share_prefixes(self._engine, self._tokenizer,
                                                 self._config.shared_prefixes)
        sessions, records = await DURABLE.run(self._store.load)
        for session in sessions:
            self._sessions[session.session_id] = session
        await self._spill.recover(sessions, records)
        await self._store.sync_index(sessions)
        self._spill.start()
        logger.info("loaded %d session(s) from %s (%d with a disk segment)", len(sessions),
                    self._config.data_dir, sum(s.segment is not None for s in sessions))

    async def rename_owners(self, renames: Mapping[str, str]) -> int:
        """Move every session of owner ``old`` to ``renames[old]`` (durably; e.g. when the API
        layer changes how owner ids are derived). Call before serving requests.

        Returns:
            How many sessions moved.

        Raises:
            GenerationFailed: A record could not be written (sessions already moved stay moved).
        """
        moved = [s for s in self._sessions.values() if s.owner in renames]
        for session in moved:
            renamed = dataclasses.replace(session, owner=renames[session.owner])
            await self._store.write(renamed)
            session.owner = renamed.owner
        if moved:
            logger.info("moved %d session(s) to their owners' new ids", len(moved))
        return len(moved)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new work, cancel generations in flight (their partial output is committed),
        write what a restart would lose to disk (``SessionConfig.shutdown_flush_s``), stop the
        sweeper and the TTL timers and close the store."""
        await self._turns.close(timeout_s)
        if self._config.shutdown_flush_s > 0:
            await self._spill.flush(self._config.shutdown_flush_s)
        self._tokenize.close()
        self._spill.close()
        await self._store.drain_index(timeout_s)
        self._pins.close()
        self._store.close()

    def health(self) -> str | None:
        """None while the sessions layer is fully healthy, else why it is degraded (the index is
        unreachable: sessions keep working on the journal; the journal cannot be written:
        sessions cannot change). The reason never names a server path."""
        return self._store.problem

    def stats(self) -> SessionStats:
        """Counts of sessions by status, generations, tokens, spills and resumes (plain
        numbers, for metrics; see ``sessions._events`` for what each counts)."""
        by_status = dict.fromkeys(("active", "idle", "host", "disk"), 0)
        for session in self._sessions.values():
            if not session.deleted:
                by_status[session.status] += 1
        host = self._spill.host
        arena = host.arena
        return self._events.stats(by_status, self._turns.num_in_flight,
                                  (host.used_bytes, host.byte_budget, self._spill.backlog_bytes),
                                  self._spill.disk_bytes,
                                  (arena.pinned_bytes, arena.fallbacks) if arena is not None else (0, 0))

    async def create(self, owner: str, *, metadata: Mapping[str, str] | None = None,
                     ttl: float | None = None, content: SessionInput | None = None,
                     tools: Sequence[ToolSpec] | None = None) -> SessionSnapshot:
        """Create a session; ``content`` becomes turn 0.

        Args:
            owner: The owner (API key).
            metadata: String labels.
            ttl: Seconds pinned after each turn; None: the server default (clamped to the max).
            content: Initial input, if any.
            tools: Tool definitions for the chat template (with ``content.messages``).

        Returns:
            The new session.

        Raises:
            ContextLengthExceeded: The content is longer than the context window.
            InvalidInput: Bad token ids, or the template rejects the messages.
            Overloaded: The manager is closing.
            GenerationFailed: The record could not be written.
        """
        self._turns.check_open()
        now = int(time.time())
        session = Session(self._new_id(), owner, now, dict(metadata or {}), self._ttl(ttl),
                          tools=tuple(tools) if tools else None)
        if content is not None:
            new = await self._resolve(owner, session, content, generate=False)
            check_context(len(new.token_ids), self.max_model_len, generate=False)
            session.token_ids = new.token_ids
            session.chat_messages = list(new.chat.messages)
            session.turns = [Turn(0, 0, len(new.token_ids), 0, None, now, len(new.chat.messages))]
        await self._store.write(session)
        self._sessions[session.session_id] = session
        async with session.lock:
            await self._pins.activate(session)
        self._events.created(session)
        return session.snapshot()

    def get(self, owner: str, session_id: str) -> SessionSnapshot:
        """Look a session up.

        Raises:
            SessionNotFound: No such session of this owner.
        """
        return self._get(owner, session_id).snapshot()

    def list_sessions(self, owner: str, *, limit: int = 20, after: str | None = None,
             parent_id: str | None = None) -> tuple[list[SessionSnapshot], bool]:
        """The owner's sessions, newest first (ids sort by creation).

        Args:
            owner: The owner.
            limit: Sessions per page (>= 1).
            after: Only sessions whose id sorts before this one.
            parent_id: Only forks of this session.

        Returns:
            The page, and whether more sessions follow it.
        """
        ids = sorted((sid for sid, s in self._sessions.items()
                      if s.owner == owner and not s.deleted
                      and (after is None or sid < after)
                      and (parent_id is None or s.parent_id == parent_id)), reverse=True)
        return [self._sessions[sid].snapshot() for sid in ids[:limit]], len(ids) > limit

    async def update(self, owner: str, session_id: str, *, metadata: Mapping[str, str] | Keep = KEEP,
                     ttl: float | None | Keep = KEEP) -> SessionSnapshot:
        """Replace the metadata and/or the TTL (None: the server default; applies from the next
        turn end).

        Raises:
            SessionNotFound: No such session of this owner.
            GenerationFailed: The record could not be written.
        """
        session = self._get(owner, session_id)
        async with session.lock:
            self._get(owner, session_id)
            changes: dict[str, Any] = {}
            if not isinstance(metadata, Keep):
                changes["metadata"] = dict(metadata)
            if not isinstance(ttl, Keep):
                changes["ttl"] = self._ttl(ttl)
            await self._store.write(dataclasses.replace(session, **changes))
            for name, value in changes.items():
                setattr(session, name, value)
        return session.snapshot()

    async def delete(self, owner: str, session_id: str) -> None:
        """Delete a session; a generation in flight is cancelled and commits nothing.

        Raises:
            SessionNotFound: No such session of this owner.
            GenerationFailed: The record could not be removed (the session is kept).
        """
        session = self._get(owner, session_id)
        session.deleted = True
        if session.generation is not None:
            session.generation.cancel(discard=True)
        try:
            await self._store.delete(session_id)
        except GenerationFailed:
            session.deleted = False
            raise
        self._sessions.pop(session_id, None)
        async with session.lock:
            await self._pins.release(session, "idle")
            await self._spill.forget(session)
        self._events.deleted(session)

    async def append(self, owner: str, session_id: str, new: SessionInput | None,
                     generate: GenerateOptions | None, *, view: str | None = None) -> Generation:
        """Start an append: new input and, with ``generate``, a generation from its end.

        The returned ``Generation`` is already running; its result is the committed turn,
        which stores ``view`` (a protocol's JSON, ``Turn.view``).

        Raises:
            SessionNotFound: No such session of this owner.
            SessionBusy: Another append runs on the session.
            ContextLengthExceeded: The session plus the input do not fit the context window.
            InvalidInput: Bad token ids, an empty session without input, template misuse, or
                a ``response_format`` / ``tool_choice`` that cannot be enforced.
            Overloaded: Too many generations in flight, or closing.
        """
        session = self._get(owner, session_id)
        self._turns.check_idle(session)
        num_turns = len(session.turns)
        resolved = await self._resolve(owner, session, new, generate is not None)
        output = None
        if generate is not None:
            output = await self._output(session.tools, session.token_ids + resolved.token_ids, generate)
        session = self._get(owner, session_id)  # still there after the input and grammar were prepared
        if len(session.turns) != num_turns:
            # The input was rendered against the turns before another append committed.
            raise SessionBusy(f"session {session_id} committed another turn while this input was "
                              "prepared; retry")
        return self._turns.append(session, resolved, generate, output, view)

    async def complete(self, prompt_ids: Sequence[int], options: GenerateOptions, *, n: int = 1,
                       tools: Sequence[ToolSpec] | None = None, owner: str | None = None) -> list[Generation]:
        """Start ``n`` stateless generations of one prompt (no session; the prefix cache still
        applies, in ``owner``'s namespace: it hits only the owner's prefixes and shared ones;
        None: the shared namespace; ``n > 1`` choices share one prefill: ``sessions._prefill``).

        Args:
            prompt_ids: The whole prompt.
            options: Generation options, shared by the ``n`` choices (with a ``seed``, choice
                ``i`` draws from ``seed + i``).
            n: The number of choices.
            tools: The tools the prompt shows the model (their calls are parsed).
            owner: The caller (API key), whose prefix-cache namespace the generations use.

        Returns:
            The started generations, one per choice.

        Raises:
            ContextLengthExceeded: The prompt leaves no room for a token.
            InvalidInput: A token id is out of range, the prompt is empty, or the output
                constraints cannot be enforced.
            Overloaded: Too many generations in flight, or closing.
        """
        if n < 1:
            raise InvalidInput(f"n: expected >= 1, got {n}")
        output = await self._output(tools, prompt_ids, options)
        return self._turns.complete(prompt_ids, options, n, output, owner)

    async def _output(self, tools: Sequence[ToolSpec] | None, prompt_ids: Sequence[int],
                      options: GenerateOptions) -> GenerationOutput:
        """The output format and grammar of a generation from ``prompt_ids``; the grammar is
        compiled here (cached), so one the engine rejects fails before anything starts."""
        fmt = output_format(self._tokenizer, tools, prompt_ids, options.tool_choice)
        grammar = build_grammar(fmt, options.response_format, options.tool_choice, options.parallel_tool_calls,
                                options.tool_call_constraint)
        if grammar is not None:
            try:
                await self._engine.compile_grammar(grammar)
            except InvalidRequest as exc:
                raise InvalidInput(str(exc)) from exc
        return GenerationOutput(fmt, grammar)

    async def fork(self, owner: str, session_id: str, n: int = 1,
                   at_turn: int | None = None) -> list[SessionSnapshot]:
        """Fork ``n`` children holding the committed turns ``0..at_turn`` (default: all).

        Raises:
            SessionNotFound: No such session of this owner.
            InvalidInput: ``at_turn`` is not a committed turn, or ``n`` < 1.
            GenerationFailed: A child's record could not be written (no child is kept).
        """
        parent = self._get(owner, session_id)
        self._turns.check_open()
        children, fork_turn = make_children(parent, owner, n, at_turn, self._new_id)
        await commit_children(children, parent, self._store, self._spill, self._pins,
                              self._sessions)
        self._events.forked(parent, children, fork_turn)
        return [child.snapshot() for child in children]

    def turns(self, owner: str, session_id: str, include_tokens: bool = False) -> list[TurnInfo]:
        """The committed turns, oldest first (a fork's inherited turns included).

        Raises:
            SessionNotFound: No such session of this owner.
        """
        session = self._get(owner, session_id)
        return [session.turn_info(turn, include_tokens) for turn in session.turns]

    def turn(self, owner: str, session_id: str, index: int, include_tokens: bool = False) -> TurnInfo:
        """One committed turn.

        Raises:
            SessionNotFound: No such session of this owner, or no such turn in it.
        """
        session = self._get(owner, session_id)
        if not 0 <= index < len(session.turns):
            raise SessionNotFound(f"session {session_id} has no turn {index}")
        return session.turn_info(session.turns[index], include_tokens)

    async def set_turn_view(self, owner: str, session_id: str, index: int, view: str | None) -> None:
        """Replace the ``view`` stored with a committed turn (durably).

        Raises:
            SessionNotFound: No such session of this owner, or no such turn in it.
            GenerationFailed: The record could not be written (nothing changed).
        """
        self.turn(owner, session_id, index)
        await self._turns.replace_view(self._get(owner, session_id), index, view)

    def _get(self, owner: str, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner or session.deleted:
            raise SessionNotFound(f"no session {session_id!r}")
        return session

    async def prompt_ids(self, owner: str, *, text: str | None = None,
                         messages: Sequence[Message] | None = None,
                         tools: Sequence[ToolSpec] | None = None,
                         template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a stateless prompt (the OpenAI routes), off the event loop: ``text`` as
        is (special-token strings recognised), or ``messages`` rendered whole with a generation
        prompt and ``template_kwargs`` (special-token strings inside them are text).

        Raises:
            ContextLengthExceeded: It cannot fit the context window (found from its length
                before tokenizing when it is far too long).
            InvalidInput: The template rejects the messages.
        """
        check_input_size(self._tokenizer, 0, text if text is not None else messages,
                         self.max_model_len, generate=True, tools=tools)
        tokenizer = self._tokenizer
        if text is not None:
            return await self._tokenize.run(owner, lambda: tokenizer.encode(text))
        assert messages is not None
        return await self._tokenize.run(owner, lambda: tokenizer.render_messages(
            messages, tools=tools, add_generation_prompt=True, template_kwargs=template_kwargs))

    async def _resolve(self, owner: str, session: Session, new: SessionInput | None,
                       generate: bool) -> ResolvedInput:
        """``new`` as token ids after ``session`` (tokenized off the event loop); an input
        that cannot fit is refused from its length first."""
        # The session's tools are rendered into its first messages only (later appends render
        # them before and after, and keep the difference).
        tools = session.chat.tools if not session.chat.messages else None
        check_input_size(self._tokenizer, len(session.token_ids), new, self.max_model_len, generate, tools)
        last = session.token_ids[-1] if session.token_ids else None
        chat, vocab, tokenizer = session.chat, self._engine.model_config.vocab_size, self._tokenizer
        if new is None or new.input_ids is not None:
            return resolve_input(tokenizer, vocab, chat, last, new, generate)
        return await self._tokenize.run(owner, lambda: resolve_input(tokenizer, vocab, chat, last, new, generate))

    def _ttl(self, ttl: float | None) -> float:
        value = self._config.default_ttl_s if ttl is None else float(ttl)
        if value < 0:
            raise InvalidInput(f"ttl: expected seconds >= 0, got {ttl}")
        return min(value, self._config.max_ttl_s)
