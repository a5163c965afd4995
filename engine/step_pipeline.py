"""Async scheduling: queue decode step N+1 on the device before reading step N's sampled ids.

A synchronous step leaves the device idle while the host reads the sampled ids, updates the
requests, schedules and prepares the next step (a sizeable fraction of a batch-1 decode step). In the steady state of decoding, step N+1 is known before step N's ids are: the same
requests, each one position further, with step N's sampled ids as input. ``next_decode_step``
builds that step from the requests' counters (before step N's update), and the runner takes its
input ids straight from step N's sampled-id tensor on the device (``ModelRunner.launch``), so the
host prepares and queues step N+1 while the device runs step N, then reads step N's ids.

What the host cannot know until it reads step N's ids is whether a request stopped. It does not
need to: a request that stops at step N still has its last token computed by step N+1, which is
exactly the turn-end *finalize* step the prefix cache wants (``Scheduler.finish``); its sampled
id is dropped. Without a prefix cache that step would be wasted work, so a request that step
N's token brings to ``max_tokens`` or the context limit (known before the token is) is left out
of step N+1; only a stop token is found too late, and costs the stopped request one token of
compute. Its memory is released at once (a later step reuses it only in device order).

Step N+1 is queued only when it is the step the scheduler would have chosen and the bookkeeping
after step N cannot change it:

- step N was a decode step (one token per request) that sampled every request still running,
  and no request is waiting (an admission would change the batch);
- no request reaches a checkpoint after step N (a periodic or prompt-end checkpoint hands the
  request's write slot to the cache, and step N+1 would write into it);
- no request is a prefill-only one, and every request gets the page for its next position
  without preemption (eviction from the cache is fine: only unlocked nodes go);
- the runner has no per-step layer hook (disaggregated prefill).

A request whose next logits depend on the token step N samples (``SamplingParams.reads_last_token``:
a grammar's mask for step N+1 is computed from token N on the host, the penalties and
``min_tokens`` count it) is queued too, but only step N+1's forward: its sampling waits for step
N's tokens (``ModelRunner.launch``). The engine reads step N's tokens while the device runs step
N+1's forward, advances the grammar matchers, and queues step N+1's sampling
(``ModelRunner.sample_queued``): the bitmask is filled on the host and copied to the device
during the forward, and the masked sampling runs as its own small launch after it. A request
that step N finished (a grammar that reached its end, a stop token) is still a row of step N+1:
its grammar is left out of the mask and its token dropped.

Under tensor parallelism the queued step's plan goes to the worker ranks at once, marked
``device_ids``, and every rank receives the ids from rank 0's device by a broadcast queued just
before the forward (``engine.step_plan``): no rank waits on the host for them.

Anything else (a new request, a prefill, a preemption, a checkpoint, an abort) runs the
synchronous path for one step. The engine drains the queued step before any call that reads or
changes request memory between steps (abort, export/import, transfers), so those see the same
state as without pipelining. The tokens are the same as the synchronous path's: the same forward
on the same inputs, the same sampling draws in the same order.
"""

from __future__ import annotations

import torch

from phloem.engine.cache_manager import CacheManager
from phloem.engine.host_copy import to_device
from phloem.engine.model_runner import LaunchedStep
from phloem.engine.request import RequestStatus
from phloem.engine.scheduler import Scheduler, SchedulerOutput
from phloem.engine.step_plan import StepInputs

__all__ = ["next_decode_step"]


def next_decode_step(
    step: LaunchedStep, scheduler: Scheduler, cache: CacheManager, max_model_len: int
) -> tuple[SchedulerOutput, StepInputs, torch.Tensor] | None:
    """The decode step that follows ``step`` (launched, not yet collected), with its device input
    ids, or None when it cannot be queued now (the module docstring lists when).

    May allocate each request the page of its next position (kept either way: the synchronous
    path would allocate the same page next step).
    """
    tokens, reqs = step.tokens, step.sampled
    if tokens is None or scheduler.waiting or any(n != 1 for n in step.sched.num_new_tokens):
        return None
    sampled = set(map(id, reqs))
    # Rows not sampled are finalize steps: those requests leave when the step is collected.
    if any(id(r) not in sampled and not r.finalizing for r in step.sched.requests):
        return None
    in_step = set(map(id, step.sched.requests))
    if any(id(r) not in in_step for r in scheduler.running):
        return None
    for req in reqs:
        # Counters are still those before ``step``: it computes position num_computed_tokens.
        computed_after = req.num_computed_tokens + 1
        if (
            req.status is not RequestStatus.RUNNING
            or req.finalizing
            or req.prefill_only
            or computed_after != req.num_tokens
            or cache.checkpoint_due(req, computed_after, req.num_tokens)
        ):
            return None
    if not scheduler.finalize:
        # No finalize step to run: leave out the requests that ``step``'s token finishes.
        keep = [i for i, r in enumerate(reqs) if not r.reaches_length(max_model_len, ahead=1)]
        if len(keep) < len(reqs):
            if not keep:
                return None
            tokens = tokens[to_device(torch.tensor(keep), tokens.device)]
            reqs = tuple(reqs[i] for i in keep)
    for req in reqs:
        if not cache.allocate_pages(req, 2):  # positions up to the one after ``step``'s token
            return None
    ps = cache.page_size
    positions = [r.num_computed_tokens + 1 for r in reqs]
    slots = [r.write_slot for r in reqs]
    assert all(s is not None for s in slots)
    n = len(reqs)
    inputs = StepInputs(
        input_ids=[0] * n,  # placeholders: the ids come from ``tokens`` on the device
        positions=positions,
        slot_mapping=[r.page_ids[p // ps] * ps + p % ps for r, p in zip(reqs, positions)],
        query_start_loc=list(range(n + 1)),
        seq_lens=[p + 1 for p in positions],
        read_slots=slots,  # type: ignore[arg-type]
        write_slots=slots,  # type: ignore[arg-type]
        has_state=[True] * n,
        query_lens=(1,) * n,
        page_ids=[r.page_ids for r in reqs],
        sample_rows=list(range(n)),
    )
    return SchedulerOutput(reqs, (1,) * n), inputs, tokens

