"""Where a response's generation runs: a new session, the head of one, a fork, or nowhere.

docs/architecture.md, "Invariants": a response is a session turn, and ``previous_response_id``
picks the turn to continue from::

    no previous_response_id        -> a new session; the response is its turn 0
    previous = the session's head  -> an append: the response is the next turn
    previous = an older turn k     -> a fork at k (copy-on-write), the response its turn k + 1
    (the head while another append runs on the session: a fork at the head, too)

The new turn's input is only the request's new items (rendered after the session's tokens,
which are never re-rendered), so the conversation's cached pages, wherever they are (GPU, host,
disk), are reused. With ``store: false`` nothing is left behind: a new conversation is a
stateless completion (the prefix cache still applies), and a continuation runs on a temporary
fork that is deleted once the generation settles. The request's fields are stored with the turn
(``Turn.view``), so ``GET /v1/responses/{id}`` can answer after a restart, as any turn can.
Which of these a request takes (and when a conversation is rendered again instead) is decided
by ``plan``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phloem.api.schemas import ErrorCode
from phloem.api.server.context import ApiContext
from phloem.api.server.errors import ApiError
from phloem.api.server.responses.input import locate, response_id, temporary_response_id
from phloem.sessions import (
    GenerateOptions, Generation, Message, SessionBusy, SessionError, SessionInput, SessionNotFound,
    ToolSpec, TurnInfo,
)

__all__ = ["Plan", "Started", "previous_turn", "start_response"]


@dataclass(frozen=True, slots=True)
class Plan:
    """A response to start: its new messages, tools, options and the record stored with it.

    Args:
        messages: The new chat messages (the instructions included, when they go in).
        tools: The tools in the template's shape.
        options: Generation options.
        template_kwargs: Chat-template variables (``enable_thinking``).
        view: What to store with the turn, given the response id (None: store nothing).
    """

    messages: list[Message]
    tools: tuple[ToolSpec, ...] | None
    options: GenerateOptions
    template_kwargs: dict[str, Any] | None
    view: Callable[[str], str] | None


@dataclass(frozen=True, slots=True)
class Started:
    """A started response: its id and its running generation."""

    rid: str
    generation: Generation


def previous_turn(ctx: ApiContext, owner: str, rid: str) -> tuple[str, TurnInfo, dict[str, Any]]:
    """The session, turn and stored record of the caller's response ``rid``.

    Raises:
        ApiError: ``not_found``: no such response of this caller (another key's, a deleted
            one, or a turn that is not a response of that session, e.g. one a fork inherited).
    """
    session_id, index = locate(rid)
    missing = ApiError(ErrorCode.NOT_FOUND, f"no response {rid[:64]!r}")
    try:
        fork_turn = ctx.manager.get(owner, session_id).fork_turn
        turn = ctx.manager.turn(owner, session_id, index)
    except SessionNotFound as exc:
        raise missing from exc
    record = json.loads(turn.view) if turn.view else None
    if (fork_turn is not None and index <= fork_turn) or record is None or "context" not in record:
        raise missing  # inherited by a fork, a native turn, or a deleted response
    return session_id, turn, record


async def start_response(ctx: ApiContext, owner: str, plan: Plan,
                         previous: tuple[str, int] | None) -> Started:
    """Start the response's generation where ``previous`` (session, turn) says (see the module
    docstring), under the caller's quotas.

    Raises:
        ApiError: A quota is exhausted.
        SessionError: The sessions layer refused the input or the options.
    """
    store = plan.view is not None
    if previous is None and not store:
        prompt = await ctx.manager.prompt_ids(owner, messages=plan.messages, tools=plan.tools,
                                              template_kwargs=plan.template_kwargs)
        generation = await ctx.start_generation(owner, lambda: _complete(ctx, owner, prompt, plan))
        return Started(temporary_response_id(), generation)
    if previous is None:
        with ctx.limits.creating_sessions(owner, 1):
            created = await ctx.manager.create(owner, tools=plan.tools)
        return await _append_or_drop(ctx, owner, created.session_id, 0, plan, temporary=False)
    session_id, index = previous
    if store:
        with contextlib.suppress(SessionBusy):
            return await _append(ctx, owner, session_id, index + 1, plan)
    with ctx.limits.creating_sessions(owner, 1):
        [child] = await ctx.manager.fork(owner, session_id, 1, at_turn=index)
    return await _append_or_drop(ctx, owner, child.session_id, index + 1, plan, temporary=not store)


async def _complete(ctx: ApiContext, owner: str, prompt: list[int], plan: Plan) -> Generation:
    [generation] = await ctx.manager.complete(prompt, plan.options, tools=plan.tools, owner=owner)
    return generation


async def _append(ctx: ApiContext, owner: str, session_id: str, index: int, plan: Plan) -> Started:
    """Append the response as turn ``index`` of the session, which must then be its next turn.

    Raises:
        SessionBusy: The session has another turn count, or an append runs on it.
    """
    rid = response_id(session_id, index) if plan.view is not None else temporary_response_id()
    view = plan.view(rid) if plan.view is not None else None
    new = SessionInput(messages=tuple(plan.messages), template_kwargs=plan.template_kwargs)

    async def start() -> Generation:
        # NOTE: no await between this check and the append's own (``SessionManager.append``
        # records the turn count before its first await, and refuses a turn committed after).
        if ctx.manager.get(owner, session_id).num_turns != index:
            raise SessionBusy(f"session {session_id} moved past turn {index - 1}")
        return await ctx.manager.append(owner, session_id, new, plan.options, view=view)
    return Started(rid, await ctx.start_generation(owner, start))


async def _append_or_drop(ctx: ApiContext, owner: str, session_id: str, index: int, plan: Plan,
                          temporary: bool) -> Started:
    """``_append`` on a session made for this response: deleted if the append does not start,
    and (``temporary``) once its generation settles."""
    try:
        started = await _append(ctx, owner, session_id, index, plan)
    except BaseException:
        await _delete_quietly(ctx, owner, session_id)
        raise
    if temporary:
        ctx.spawn(_delete_after(ctx, owner, session_id, started.generation.result))
    return started


async def _delete_after(ctx: ApiContext, owner: str, session_id: str,
                        settled: Callable[[], Awaitable[object]]) -> None:
    with contextlib.suppress(SessionError):
        await settled()
    await _delete_quietly(ctx, owner, session_id)


async def _delete_quietly(ctx: ApiContext, owner: str, session_id: str) -> None:
    with contextlib.suppress(SessionError):
        await ctx.manager.delete(owner, session_id)
