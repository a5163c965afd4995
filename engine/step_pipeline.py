"""Async scheduling: queue step N+1 on the device before reading step N's sampled ids.

A synchronous step leaves the device idle while the host reads the sampled ids, updates the
requests, schedules and prepares the next step (a sizeable fraction of a batch-1 decode step).
In the steady state of decoding, step N+1 is known before step N's ids are: the same requests,
each one position further, with step N's sampled ids as input. ``next_step``
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

- every request of step N that goes on was sampled by it: a decode row, or a prefill row that
  computes the rest of its prompt (a prefill, a tool result beside the decode batch), and every
  running request is in step N;
- no request is a prefill-only one, and every request gets the page for its next position
  without preemption (eviction from the cache is fine: only unlocked nodes go);
- a request whose prompt ends at step N (its prompt-end checkpoint hands its write slot to the
  cache when step N is collected) gets the slot it continues in, and the page the checkpoint's
  tail copy goes to, now (``CacheManager.reserve_checkpoint``): step N+1 reads the state from the
  slot being handed over and writes the new one;
- the runner has no per-step layer hook (disaggregated prefill).

Step N+1's rows are the running requests in arrival order, the order the scheduler gives a
decode batch (a tool result's row, last in step N, takes its place among them).

Requests waiting meanwhile (an agent's tool result, a new prompt) are admitted into step N+1
beside its decode rows (``Scheduler.admit_beside``), as the scheduler would admit them after step
N: step N+1 is then a mixed step, queued like a decode step, its prefill rows' ids from the host
after the decode rows' ids from the device. Without this, the arrival of each tool result stopped
the pipeline for one step: the device idled while the host read step N's ids, then matched the
turn's prefix, admitted it and planned the mixed step. Admission takes only memory that step N
does not touch (free pages and slots, or cached ones no request holds; a copy-on-write tail page
is copied in device order, behind step N; a spilled prefix's copy on its side stream waits for
step N, and step N+1 for the copy), so it does not wait for step N. The step is not queued (the
synchronous path admits) when admission would preempt a running request: every seat taken and a
claimant that a seat would be yielded to (``Scheduler.admits_beside``); with every seat taken and
no seat to yield, the decode rows are queued alone, as the synchronous path would run them. A
request that extends one whose turn-end checkpoint step N writes waits a step, as it does in
``Scheduler.schedule``; a prefix that step N's collection publishes (a prompt-end or turn-end
checkpoint) is not there yet for a request admitted beside it.

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

Anything else (a prefill chunk that does not end its prompt, a preemption, an abort) runs the
synchronous path for one step. The engine drains the queued step before any call
that reads or changes request memory between steps (abort, export/import, transfers), so those
see the same state as without pipelining. The tokens are the same as the synchronous path's: the
same forward on the same inputs, the same sampling draws in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from phloem.engine.cache.manager import CacheManager
from phloem.engine.host_copy import to_device
from phloem.engine.model_runner import LaunchedStep
from phloem.engine.request import RequestStatus
from phloem.engine.scheduler import Scheduler, SchedulerOutput
from phloem.engine.step_plan import StepInputs

__all__ = ["next_step"]

QueuedStep = tuple[SchedulerOutput, StepInputs, torch.Tensor]


def next_step(
    step: LaunchedStep, scheduler: Scheduler, cache: CacheManager, max_model_len: int,
    prepare: Callable[[SchedulerOutput], StepInputs],
) -> QueuedStep | None:
    """The step that follows ``step`` (launched, not yet collected), with its device input ids,
    or None when it cannot be queued now (the module docstring lists when): the decode rows of
    ``step``'s requests, then the waiting requests admitted beside them (``prepare`` builds those
    rows' inputs, ``ModelRunner.prepare_inputs``).

    May allocate each request the page of its next position, and the slot and tail page of a
    prompt-end checkpoint (kept either way: the synchronous path would allocate the same next step).
    """
    if scheduler.waiting and not scheduler.admits_beside():
        return None
    decode = _next_decode_rows(step, scheduler, cache, max_model_len)
    if decode is None or not scheduler.waiting:
        return decode
    sched, inputs, tokens = decode
    admitted = scheduler.admit_beside(sched.requests)
    if admitted.is_empty:
        return decode
    extra = prepare(admitted)
    ids = torch.cat((tokens, to_device(torch.tensor(extra.input_ids, dtype=tokens.dtype), tokens.device)))
    both = SchedulerOutput(sched.requests + admitted.requests, sched.num_new_tokens + admitted.num_new_tokens)
    return both, inputs.then(extra), ids


def _next_decode_rows(
    step: LaunchedStep, scheduler: Scheduler, cache: CacheManager, max_model_len: int
) -> QueuedStep | None:
    """The decode rows that follow ``step``: one for each of its requests that goes on."""
    tokens, reqs = step.tokens, step.sampled
    if tokens is None:
        return None
    sampled = set(map(id, reqs))
    # Rows not sampled are finalize steps: those requests leave when the step is collected.
    if any(id(r) not in sampled and not r.finalizing for r in step.sched.requests):
        return None
    in_step = set(map(id, step.sched.requests))
    if any(id(r) not in in_step for r in scheduler.running):
        return None
    num_new = {id(r): n for r, n in zip(step.sched.requests, step.sched.num_new_tokens)}
    # Counters are still those before ``step``: it computes positions up to computed_after - 1.
    computed_after = {id(r): r.num_computed_tokens + num_new[id(r)] for r in reqs}
    for req in reqs:
        if (
            req.status is not RequestStatus.RUNNING
            or req.finalizing
            or req.prefill_only
            or computed_after[id(req)] != req.num_tokens
        ):
            return None
    rows = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_idx)
    if not scheduler.finalize:
        # No finalize step to run: leave out the requests that ``step``'s token finishes.
        rows = [i for i in rows if not reqs[i].reaches_length(max_model_len, ahead=1)]
        if not rows:
            return None
    for i in rows:
        req = reqs[i]
        # Pages up to the position after ``step``'s token.
        if not cache.allocate_pages(req, num_new[id(req)] + 1):
            return None
        after = computed_after[id(req)]
        if cache.checkpoint_due(req, after, req.num_tokens) and not cache.reserve_checkpoint(req, after):
            return None
    if rows != list(range(len(reqs))):
        tokens = tokens[to_device(torch.tensor(rows), tokens.device)]
    queued = [reqs[i] for i in rows]
    ps = cache.page_size
    positions = [computed_after[id(r)] for r in queued]
    read_slots = [r.write_slot for r in queued]
    write_slots = [r.checkpoint_reservation[0] if r.checkpoint_reservation else r.write_slot for r in queued]
    assert all(s is not None for s in read_slots)
    n = len(queued)
    inputs = StepInputs(
        input_ids=[0] * n,  # placeholders: the ids come from ``tokens`` on the device
        positions=positions,
        slot_mapping=[r.page_ids[p // ps] * ps + p % ps for r, p in zip(queued, positions)],
        query_start_loc=list(range(n + 1)),
        seq_lens=[p + 1 for p in positions],
        read_slots=read_slots,  # type: ignore[arg-type]
        write_slots=write_slots,  # type: ignore[arg-type]
        has_state=[True] * n,
        query_lens=(1,) * n,
        page_ids=[r.page_ids for r in queued],
        sample_rows=list(range(n)),
    )
    return SchedulerOutput(tuple(queued), (1,) * n), inputs, tokens
