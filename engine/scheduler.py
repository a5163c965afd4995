"""Continuous batching: which requests run this step, and how many tokens each.

Policy, in order, under one token budget (``max_num_batched_tokens``):

1. running requests that decode (one token each), then running requests still prefilling, in
   arrival order; a prefill continues in chunks when the budget is short (chunked prefill);
2. waiting requests, first come first served, while the budget, ``max_num_seqs``, state slots
   and KV pages allow. Admission is check-then-commit: a request that cannot get both its
   slot and its pages takes nothing and stays first in line.

When a running request needs a page and none is free (even after the radix cache evicted what
it could), the newest running request is preempted: its computed prefix is published to the
radix cache (so re-admission usually resumes from there), its private memory goes back to the
pools, and it waits again with its tokens intact. Preemption never corrupts: whatever is
recomputed gives the same state.

Prefill chunks are cut at multiples of ``checkpoint_interval`` so that each periodic checkpoint
is the final state of a step (no kernel has to emit intermediate states).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from phloem.engine.cache_manager import CacheManager
from phloem.engine.config import SchedulerConfig
from phloem.engine.request import FinishReason, Request, RequestStatus

__all__ = ["Scheduler", "SchedulerOutput"]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    # Requests that could never fit (alone in the engine and still short of pages): finished.
    finished_early: tuple[Request, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager, finalize: bool = False) -> None:
        self.config = config
        self.cache = cache
        # Run each finished request's last token once more to checkpoint the whole turn.
        self.finalize = finalize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        num_new: list[int] = []
        failed: list[Request] = []
        # Decode (exactly one token left to compute) before prefill continuations.
        order = sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.arrival_idx))
        for req in order:
            if budget == 0:
                break
            if req not in self.running:
                continue  # preempted earlier in this loop
            n = self._chunk(req, budget)
            if not self._reserve_pages(req, n, scheduled, failed):
                continue
            scheduled.append(req)
            num_new.append(n)
            budget -= n
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._extends_finalizing(req):
                # Its prefix checkpoint lands at the end of this step: admit it next step, as a hit.
                deferred.append(self.waiting.popleft())
                continue
            if not self.cache.admit(req):
                break
            n = self._chunk(req, budget)
            if not self.cache.allocate_pages(req, n):
                self.cache.release(req, publish=False)
                if not self.running:
                    # Alone and still short: it can never run.
                    self.waiting.popleft()
                    self._finish(req, FinishReason.LENGTH)
                    failed.append(req)
                    continue
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            num_new.append(n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return SchedulerOutput(tuple(scheduled), tuple(num_new), tuple(failed))

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
        if every > 0:
            n = min(n, (start // every + 1) * every - start)
        return n

    def _reserve_pages(self, req: Request, n: int, scheduled: list[Request], failed: list[Request]) -> bool:
        """Allocate pages for ``n`` new tokens of a running request, preempting newer ones if needed."""
        while not self.cache.allocate_pages(req, n):
            victims = [r for r in self.running if r is not req and r not in scheduled]
            if not victims:
                if len(self.running) == 1 and not req.finalizing:
                    self._finish(req, FinishReason.LENGTH)
                    failed.append(req)
                else:
                    self._preempt(req)
                return False
            self._preempt(max(victims, key=lambda r: r.arrival_idx))
        return True

    def _preempt(self, req: Request) -> None:
        self.cache.release(req, publish=True)
        self.running.remove(req)
        if req.finalizing:
            req.finalizing = False  # already finished for the caller; only its checkpoint is lost
            return
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
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
