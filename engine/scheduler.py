"""Continuous batching: which requests run this step, and how many tokens each.

Policy, in order, under one token budget (``max_num_batched_tokens``):

1. running requests that decode (one token each);
2. *short* prefills: work that fits in one step's budget (an agent's next turn, whose history
   the prefix cache holds), running ones first, then waiting ones, *smallest first* (fewest
   tokens past the cached prefix, then arrival order);
3. *long* prefills (a fresh 50K-token first turn), running ones, continuing in chunks when the
   budget is short (chunked prefill), then waiting ones, first come first served.

So an agent's turn never queues behind other agents' first turns: with chunked prefill a long
prompt yields each step's budget to the short work waiting beside it and takes the rest, and a
fresh prompt that fits one step (an 8K first turn under an 8K budget) is short too, but larger
than a turn's tool result, so it waits behind it. A waiting request's size is its tokens past its
cached prefix, looked up once when it is first considered (a hint: the tree may change before
it is admitted). Admission is check-then-commit: a request that cannot get both its slot and its
pages takes nothing, and no request is admitted after it in that step (it stays first in line).

Running requests are scheduled within each class by *rank*: the work they brought (prompt
tokens past the prefix they were admitted on), then arrival order. When a running request needs
a page and none is free (even after the radix cache evicted what it could), the lowest-ranked
running request not yet in the step is preempted: the fresh prompt with the most tokens, the
newest of equals; an agent's turn (a few hundred new tokens on a long cached history) only when
no fresh prompt is left. Preempting the newest request instead took the agents' turns every time
(they arrive after the first turns queued ahead of them): each lost the history it resumed on,
came back as a long recompute and was preempted again, until every first turn was served. The
preempted request's computed prefix is published to the radix cache (so re-admission usually
resumes from there), its private memory goes back to the pools, and it waits again with its
tokens intact. Preemption never corrupts: whatever is recomputed gives the same state.

Seats (``max_num_seqs``) are yielded the same way. With every seat taken, a short request that was
never admitted (an agent's turn back from its tool) preempts the running request that brought the
most work, if that is at least ``seat_yield_min_tokens`` more than its own: in a burst of fresh
prompts every seat decodes a first turn for hundreds of steps, and a turn that waited for one of
them to finish waited seconds for a few hundred tokens of work. Only as many turns claim a seat as
the step's budget can admit. A preempted request waits in the short line ranked by the work it
first brought, not by its few tokens left past its published prefix (``_waiting_rank``), so it
takes no seat back from the turns and comes back as the first seats free. Requests of about one
size never trade seats (the margin). The trade is the one smallest-first admission already makes:
while short requests keep every seat busy, a long prompt's decode waits; protecting a request
admitted again after a preemption would bound that wait but keeps agents' turns waiting again
(``docs/decisions.md``).

Prefill chunks are cut at multiples of ``checkpoint_interval`` so that each periodic checkpoint
is the final state of a step (no kernel has to emit intermediate states); likewise at a
request's branch point and one token before its prompt's end (``CacheManager.chunk_stops``). One exception: the
last chunk of a request that resumed from the cache, where a checkpoint is published at the end
anyway (``CacheManager.checkpoints_at_end``). That is an agent's next turn, whose new tokens (a
tool result) are the conversation's own: a checkpoint inside them would serve only a fork that
diverges inside them, while the cut would run the turn in two steps, each one reading every
expert's weights beside the decode batch. A fresh prompt keeps its periodic checkpoints, which
other prompts sharing part of it (a system prompt) resume from.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from phloem.engine.cache.manager import CacheManager
from phloem.engine.config import SchedulerConfig
from phloem.engine.request import FinishReason, Request, RequestStatus, SpilledPrefix

__all__ = ["Scheduler", "SchedulerOutput"]

logger = logging.getLogger(__name__)

# Loads a spilled prefix into the cache in a namespace (``Engine.import_prefix``); False: no room.
LoadPrefix = Callable[[SpilledPrefix, "str | None"], bool]

# Size classes, scheduled in this order.
_DECODE, _SHORT, _LONG = 0, 1, 2


def _rank(req: Request) -> tuple[int, int]:
    """A running request's rank, lowest first: the prompt tokens it brought past the prefix it
    was admitted on (``num_cached_tokens`` is fixed at its first admission), then arrival.
    Scheduled in this order within a size class; preempted highest first."""
    return req.num_prompt_tokens - req.num_cached_tokens, req.arrival_idx


def _waiting_rank(req: Request) -> tuple[int, int]:
    """A waiting request's place in the short line, lowest first: its tokens past its cached
    prefix, or, if it ran before (preempted), the work it brought then when that is more; then
    arrival. ``num_uncached_hint`` must be set (``Scheduler._size_class``)."""
    assert req.num_uncached_hint is not None
    brought = req.num_prompt_tokens - req.num_cached_tokens if req.num_admissions else 0
    return max(req.num_uncached_hint, brought), req.arrival_idx


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    # Requests that could never fit (alone in the engine and still short of pages): finished.
    finished_early: tuple[Request, ...] = ()

    @property
    def kind(self) -> str:
        """``decode`` (one token per request), ``prefill`` (no one-token row) or ``mixed``."""
        counts = self.num_new_tokens
        return "decode" if all(n == 1 for n in counts) else "mixed" if 1 in counts else "prefill"

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class _Step:
    """The step being built: its requests, their token counts and the budget left."""

    budget: int
    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    blocked: bool = False  # an admission was refused: nothing more is admitted this step
    scheduled: set[int] = field(default_factory=set)  # ids of ``requests``: one row a request

    def add(self, req: Request, n: int) -> None:
        assert id(req) not in self.scheduled, f"request {req.request_id} scheduled twice in a step"
        self.scheduled.add(id(req))
        self.requests.append(req)
        self.num_new.append(n)
        self.budget -= n


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, finalize: bool = False,
                 load_prefix: LoadPrefix | None = None) -> None:
        self.config = config
        self.cache = cache
        # Loads a waiting request's spilled prefix (``Request.resume``) as it is admitted: the
        # copy takes its place in the queue like the request's own memory (``_load_resume``).
        self.load_prefix = load_prefix
        # Run each finished request's last token once more to checkpoint the whole turn.
        self.finalize = finalize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # The last admission attempt was refused for lack of memory (pages or state slots, after
        # the radix cache evicted what it could): the waiting requests wait for memory, not for
        # their turn (``Engine.waits_for_memory``).
        self.memory_blocked = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.config.max_num_batched_tokens)
        self._yield_seats()
        order = sorted(self.running, key=lambda r: (self._size_class(r), _rank(r)))
        for size_class in (_DECODE, _SHORT, _LONG):
            for req in order:
                if self._size_class(req) == size_class:
                    self._continue(req, step)
            if size_class != _DECODE:
                self._admit_waiting(step, short_only=size_class == _SHORT)
        return SchedulerOutput(tuple(step.requests), tuple(step.num_new), tuple(step.failed))

    def admits_beside(self) -> bool:
        """Whether ``admit_beside`` may run: admitting the waiting requests into a step queued
        behind one in flight must not preempt a running request, as a yielded seat would. With
        every seat taken and no seat to yield (no claimant brings ``seat_yield_min_tokens`` less
        work than a running request, ``_seat_yields``) it admits nothing, and the queued step is
        the decode rows alone, as the synchronous path's would be. A spilled prefix may load: its
        copy waits for the steps queued so far (``ModelRunner.write_state_async``) and the step
        that reads it for the copy."""
        return len(self.running) < self.config.max_num_seqs or next(self._seat_yields(), None) is None

    def admit_beside(self, decode: tuple[Request, ...]) -> SchedulerOutput:
        """Admit waiting requests into the step queued behind the one in flight
        (``engine.step_pipeline``), whose rows are ``decode``: every running request, one token
        each, its page allocated. This is the admission ``schedule`` makes once the step in flight
        is collected (its decode rows first, then short requests smallest first, then the rest in
        line), under the budget the rows leave; returns the admitted rows (none when the budget,
        the seats or memory refuse). Only when ``admits_beside``."""
        assert self.admits_beside()
        step = _Step(self.config.max_num_batched_tokens - len(decode))
        step.scheduled.update(map(id, decode))
        self._admit_waiting(step, short_only=True)
        self._admit_waiting(step, short_only=False)
        # A request is finished early only when nothing runs; ``decode`` runs.
        assert not step.failed, "a request failed admission beside running requests"
        return SchedulerOutput(tuple(step.requests), tuple(step.num_new))

    def _yield_seats(self) -> None:
        """Preempt the running requests ``_seat_yields`` names, each before the next is chosen."""
        for victim in self._seat_yields():
            self._preempt(victim)

    def _seat_yields(self) -> Iterator[Request]:
        """With every seat taken, for each short request never admitted before (in line order,
        while the step's budget past one decode token a seat can admit it), the running request
        that brought the most work, if that is ``seat_yield_min_tokens`` more than the claimant's
        (``_waiting_rank``). Lazy: a caller that preempts each one changes the next choice; the
        first alone says whether a seat would be yielded now (``_rank`` does not change as a
        request decodes, so only arrivals and finished requests change the answer)."""
        margin = self.config.seat_yield_min_tokens
        if margin is None or len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        claimants = sorted(
            (r for r in self.waiting
             if r.num_admissions == 0 and self._size_class(r) == _SHORT and not self._extends_finalizing(r)),
            key=_waiting_rank)
        budget = self.config.max_num_batched_tokens - len(self.running)
        for claimant in claimants:
            budget -= claimant.num_uncached_hint or 0
            victims = [r for r in self.running if not r.finalizing]
            if budget < 0 or not victims:
                return
            victim = max(victims, key=_rank)
            if _rank(victim)[0] - _waiting_rank(claimant)[0] < margin:
                return
            yield victim

    def _size_class(self, req: Request) -> int:
        """``_DECODE``, ``_SHORT`` (the rest of its prefill fits one step) or ``_LONG``."""
        if req.status is RequestStatus.RUNNING:
            left = req.num_tokens - req.num_computed_tokens
        else:
            if req.num_uncached_hint is None:
                cached = self.cache.cached_len(req.all_token_ids, req.namespace)
                if req.resume is not None:
                    cached = max(cached, req.resume.num_tokens)
                req.num_uncached_hint = req.num_tokens - cached
            left = req.num_uncached_hint
        if left <= 1 and req.status is RequestStatus.RUNNING:
            return _DECODE
        return _SHORT if left <= self.config.max_num_batched_tokens else _LONG

    def _continue(self, req: Request, step: _Step) -> None:
        """Schedule the next tokens of a running request, if the budget and its pages allow."""
        if step.budget == 0 or req not in self.running or id(req) in step.scheduled:
            # Out of budget, or preempted earlier in this step, or preempted and admitted again
            # (``order`` was taken before it): a second row would write its state slot twice.
            return
        n = self._chunk(req, step.budget)
        if self._reserve_pages(req, n, step):
            step.add(req, n)

    def _admit_waiting(self, step: _Step, short_only: bool) -> None:
        """Admit waiting requests while the budget, ``max_num_seqs`` and memory allow: with
        ``short_only`` the short ones, smallest first; else all in queue order. A refusal ends
        admission for the step."""
        if short_only:
            line = sorted((r for r in self.waiting if self._size_class(r) == _SHORT),
                          key=_waiting_rank)
        else:
            line = list(self.waiting)
        admitted: set[Request] = set()
        for req in line:
            if step.blocked or step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._extends_finalizing(req):
                continue  # its prefix checkpoint lands at the end of this step: next step, as a hit
            if not self._admit(req, step):
                step.blocked = True
            else:
                admitted.add(req)
                self.memory_blocked = False
        if admitted:
            self.waiting = deque(r for r in self.waiting if r not in admitted)
        self.memory_blocked = (self.memory_blocked or step.blocked) and bool(self.waiting)

    def _admit(self, req: Request, step: _Step) -> bool:
        """Give ``req`` its memory and its first chunk; False (taking nothing) when memory is short."""
        if not self._load_resume(req):
            if self._memory_can_return():
                return False  # the load keeps its place in line
            # Alone, nothing locked, and no room for the whole prefix at once: recompute it,
            # in chunks, which needs only a chunk's pages at a time.
            req.resume = None
        if not self.cache.admit(req):
            return False
        n = self._chunk(req, step.budget)
        if not self.cache.allocate_pages(req, n):
            self.cache.release(req, publish=False)
            return self._short(req, step)
        req.resume = None
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.add(req, n)
        return True

    def _short(self, req: Request, step: _Step) -> bool:
        """``req`` is short of memory: wait (False) while memory can come back, else finish it."""
        if self._memory_can_return():
            return False
        # Alone, nothing locked, and still short: it can never run.
        self._finish(req, FinishReason.LENGTH)
        step.failed.append(req)
        return True

    def _memory_can_return(self) -> bool:
        """Memory comes back when a running request ends, or a locked node is unlocked: a
        hand-off hold ends (at its pin or admission, or after ``handoff_hold_s``:
        ``engine.cache.holds``, whose holds are locks), or a pin goes (the sessions layer
        demotes pinned sessions for a request that waits for memory)."""
        tree = self.cache.tree
        return bool(self.running) or (tree is not None and tree.has_locks)

    def _load_resume(self, req: Request) -> bool:
        """Load ``req``'s spilled prefix into the cache, now that it is first in line, unless the
        cache holds it already. False: no room for it (it waits, as for its own pages).

        The load is part of admission, not a separate call before the request: a resume then
        takes memory in queue order and is never starved by the requests queued behind it (which
        would take every page a step frees first), and the loaded prefix is admitted on at once
        (the hand-off hold ``import_prefix`` puts on it ends in ``CacheManager.admit``). A state
        this engine cannot load (wrong shapes) is dropped: the request recomputes it."""
        state = req.resume
        if state is None or self.load_prefix is None:
            return True
        if self.cache.cached_len(req.all_token_ids, req.namespace) >= state.num_tokens:
            return True
        try:
            loaded = self.load_prefix(state, req.namespace)
        except ValueError as exc:
            logger.warning("request %s: cannot load its spilled prefix (%s); recomputing it", req.request_id, exc)
            req.resume = None
            return True
        if loaded:
            req.num_resumed_tokens = state.num_tokens
        return loaded

    def _extends_finalizing(self, req: Request) -> bool:
        tokens = req.all_token_ids
        return any(
            f.finalizing and len(tokens) > f.num_tokens and tokens[: f.num_tokens] == f.all_token_ids
            for f in self.running
            if f.finalizing
        )

    def _chunk(self, req: Request, budget: int) -> int:
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget)
        every = self.cache.checkpoint_interval
        resumed_turn = req.num_cached_tokens > 0 and self.cache.checkpoints_at_end(req)
        if every > 0 and not (resumed_turn and start + n >= req.num_tokens - 1):
            n = min(n, (start // every + 1) * every - start)
        for stop in self.cache.chunk_stops(req):
            if start < stop < start + n:
                n = stop - start
        return n

    def _reserve_pages(self, req: Request, n: int, step: _Step) -> bool:
        """Allocate pages for ``n`` new tokens of a running request, preempting the highest-ranked
        running request not in the step if needed."""
        while not self.cache.allocate_pages(req, n):
            victims = [r for r in self.running if r is not req and id(r) not in step.scheduled]
            if not victims:
                if len(self.running) == 1 and not req.finalizing:
                    self._finish(req, FinishReason.LENGTH)
                    step.failed.append(req)
                else:
                    self._preempt(req)
                return False
            self._preempt(max(victims, key=_rank))
        return True

    def _preempt(self, req: Request) -> None:
        self.cache.release(req, publish=True)
        self.running.remove(req)
        if req.finalizing:
            req.finalizing = False  # already finished for the caller; only its checkpoint is lost
            return
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_uncached_hint = None
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finalizing = False
        if req in self.running:
            self.running.remove(req)
        self.cache.release(req, publish=True)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Finish a running request (stop condition met).

        With ``finalize``, the request stays in the running set for one more step that computes
        its last token (no sample), then ``complete_finalize`` publishes the turn-end checkpoint.
        """
        if self.finalize and reason is not FinishReason.ABORT:
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            req.finalizing = True
            return
        self._finish(req, reason)

    def finish_now(self, req: Request, reason: FinishReason) -> None:
        """Finish and release at once (publishing what was computed), with no finalize step."""
        self._finish(req, reason)

    def complete_finalize(self, req: Request) -> None:
        assert req.finalizing and req.num_computed_tokens == req.num_tokens, "finalize step did not run"
        req.finalizing = False
        self.running.remove(req)
        self.cache.release(req, publish=True)

    def num_finalizing(self) -> int:
        return sum(r.finalizing for r in self.running)

    def abort(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; returns it, or None if unknown."""
        for req in list(self.running):
            if req.request_id == request_id:
                reason = req.finish_reason if req.finalizing else FinishReason.ABORT
                self._finish(req, reason or FinishReason.ABORT)
                return req
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED
                req.finish_reason = FinishReason.ABORT
                return req
        return None
