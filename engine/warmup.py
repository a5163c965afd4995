"""Warm-up: run every kind of step the engine will serve once, before it serves anyone.

On a GPU the first use of a kernel variant compiles it: Triton kernels per constexpr set, dtype
and integer specialisation (a length of 1, a multiple of 16, anything else), FlashInfer's JIT
modules per attention shape (prefill with and without KV history, decode), fla's chunked GDN
kernels. CUDA-graph capture (``Engine.__init__``) has already compiled the decode steps of every
captured batch size; a first request would still compile its prefill, and a cold machine took
minutes for it. ``warm_up`` sends the engine a few requests that reach the other variants,
through ``add_request`` / ``step`` like served requests:

    chunked    a prompt of one step budget plus half of one plus 3 tokens: a full prefill chunk,
               then a chunk of odd length over KV history; greedy decode
    prefix     that prompt plus 16 tokens: a radix hit resumed from a checkpoint; top-k/top-p
               sampling with a seed
    batch      prompts of 1, 7, 100 and 300 tokens in one step (small and grouped MoE paths,
               varlen attention), decoded as a batch of 4
    mixed      a short request decoding while a longer one prefills in the same steps

Lengths are capped by the context window and the pools. Afterwards the engine is as before: no
request, an empty radix cache (what it held before is dropped too: call this before serving),
every page and slot free, and its counters (prompt and cached tokens, checkpoints, preemptions,
pipelined steps) restored, so metrics count only served traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phloem.engine.progress_bars import progress_bar
from phloem.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from phloem.engine.engine import Engine

__all__ = ["WarmupReport", "warm_up"]

_GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)
_SAMPLED = SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, top_k=40, seed=1, ignore_eos=True)
_BATCH_LENS = (1, 7, 100, 300)


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What ``warm_up`` ran: requests, engine steps, prompt tokens, and the wall time."""

    num_requests: int
    num_steps: int
    num_prompt_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _Request:
    prompt: list[int]
    params: SamplingParams
    after_steps: int = 0  # added once the round has run this many steps


def warm_up(engine: Engine, show_progress: bool | None = None) -> WarmupReport:
    """Run the warm-up rounds (module docstring) to completion and restore the engine.

    Args:
        engine: An engine that serves nothing yet (no request in flight).
        show_progress: A bar over the requests: False never, None when stderr is a terminal.

    Returns:
        What ran.
    """
    assert not engine.has_unfinished_requests(), "warm up an engine before it serves requests"
    rounds = _rounds(engine)
    counters = _Counters.take(engine)
    free = (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots)
    t0 = time.perf_counter()
    num_steps = 0
    with progress_bar(sum(len(r) for r in rounds), "warming up kernels", "request", show_progress) as advance:
        for requests in rounds:
            num_steps += _run(engine, requests, advance)
    if engine.cache.tree is not None:
        engine.cache.tree.clear()
    counters.restore(engine)
    assert (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots) == free, "warm-up leaked memory"
    num_prompt = sum(len(r.prompt) for requests in rounds for r in requests)
    return WarmupReport(sum(len(r) for r in rounds), num_steps, num_prompt, time.perf_counter() - t0)


def _rounds(engine: Engine) -> list[list[_Request]]:
    budget = engine.scheduler.config.max_num_batched_tokens
    # A prompt and its output fit the context window and a quarter of the KV pool.
    room = min(engine.max_model_len - 1, engine.page_pool.num_free_pages * engine.page_pool.page_size // 4)
    vocab = engine.model_config.vocab_size

    def request(n: int, seed: int, params: SamplingParams, after_steps: int = 0) -> _Request:
        n = max(1, min(n, room - params.max_tokens))
        return _Request([(seed * 7919 + i * 104729) % vocab for i in range(n)], params, after_steps)

    long = request(budget + budget // 2 + 3, 1, _GREEDY)
    out = [[long]]
    if len(long.prompt) + 16 + _SAMPLED.max_tokens <= room:
        out.append([_Request(long.prompt + request(16, 2, _SAMPLED).prompt, _SAMPLED)])
    # Long enough that all four decode together after the longest prompt's last chunk.
    batch = SamplingParams(max_tokens=4 + sum(_BATCH_LENS) // budget, ignore_eos=True)
    out.append([request(n, 3 + n, batch) for n in _BATCH_LENS])
    mixed = SamplingParams(max_tokens=6, ignore_eos=True)
    out.append([request(20, 5, mixed), request(budget // 2 + 5, 6, _GREEDY, after_steps=2)])
    return out


def _run(engine: Engine, requests: list[_Request], advance: Callable[[int], None]) -> int:
    """Run one round to completion (turn-end checkpoints included); returns its steps."""
    pending = sorted(requests, key=lambda r: r.after_steps)
    ids: set[str] = set()
    steps = 0
    while pending or engine.has_unfinished_requests() or engine.scheduler.num_finalizing():
        while pending and pending[0].after_steps <= steps:
            request = pending.pop(0)
            ids.add(engine.add_request(request.prompt, request.params))
        for output in engine.step():
            if output.finished and output.request_id in ids:
                advance(1)
        steps += 1
    engine.drain()
    return steps


@dataclass(frozen=True, slots=True)
class _Counters:
    """The engine's cumulative counters, so the warm-up leaves them as they were."""

    prompt_tokens: int
    cached_tokens: int
    checkpoints_created: int
    checkpoints_evicted: int
    num_preemptions: int
    num_pipelined_steps: int
    num_pipelined_mixed_steps: int

    @classmethod
    def take(cls, engine: Engine) -> _Counters:
        tree = engine.cache.tree
        return cls(engine.cache.prompt_tokens, engine.cache.cached_tokens,
                   tree.checkpoints_created if tree else 0, tree.checkpoints_evicted if tree else 0,
                   engine.scheduler.num_preemptions, engine.num_pipelined_steps,
                   engine.num_pipelined_mixed_steps)

    def restore(self, engine: Engine) -> None:
        engine.cache.prompt_tokens, engine.cache.cached_tokens = self.prompt_tokens, self.cached_tokens
        if engine.cache.tree is not None:
            engine.cache.tree.checkpoints_created = self.checkpoints_created
            engine.cache.tree.checkpoints_evicted = self.checkpoints_evicted
        engine.scheduler.num_preemptions = self.num_preemptions
        engine.num_pipelined_steps = self.num_pipelined_steps
        engine.num_pipelined_mixed_steps = self.num_pipelined_mixed_steps
