"""Decode speed on the served path: requests through the engine loop, as the server sends them.

``run_decode`` (``benchmarks.decode``) injects synthetic running requests and times
``engine.step()`` alone; what a user gets also pays admission, the prefill, each step's outputs
(``RequestOutput``) and their delivery to the request's sink on the engine thread, and the
finishing steps. Here ``batch`` requests are submitted to an ``EngineLoop`` like the server's
(``AddRequest`` with an output sink), greedy with ``ignore_eos``, and each request's decode speed
is read from the arrival times of its tokens at its sink, over the window in which every request
decodes: from the ``warmup``-th token of the last request to arrive to the last token of the
first to finish (the requests are added one at a time, and each arrival's prefill joins a step).

The requests share a ``context - 64``-token prefix, computed once (a prefill-only request) and
then hit in the prefix cache, plus 64 tokens of their own: a batch at 128K tokens of context
then costs one long prefill, not ``batch`` of them. Every request still reads its whole context
each step (the shared pages are read once per request, as distinct ones would be).
"""

from __future__ import annotations

import random
import statistics
import threading
import time

from phloem.engine import Engine, EngineError, RequestOutput, SamplingParams
from phloem.runtime.engine_commands import AddRequest
from phloem.runtime.engine_loop import EngineLoop

__all__ = ["OWN_TOKENS", "run_served_decode"]

OWN_TOKENS = 64  # tokens of each request's prompt past the shared prefix
_TIMEOUT_S = 3600.0


class _Arrivals:
    """An output sink recording when each of its request's tokens arrived."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.error: EngineError | None = None
        self.done = threading.Event()

    def __call__(self, item: RequestOutput | EngineError) -> None:
        if isinstance(item, EngineError):
            self.error = item
            self.done.set()
            return
        now = time.perf_counter()
        self.times.extend([now] * len(item.new_token_ids))
        if item.finished:
            self.done.set()


def _submit(loop: EngineLoop, prompt: list[int], params: SamplingParams, prefill_only: bool = False) -> _Arrivals:
    sink = _Arrivals()
    command = AddRequest(tuple(prompt), params, None, sink, prefill_only=prefill_only)
    loop.submit(command)
    command.reply.result(_TIMEOUT_S)
    return sink


def _wait(sinks: list[_Arrivals]) -> None:
    for sink in sinks:
        if not sink.done.wait(_TIMEOUT_S):
            raise TimeoutError("a served request did not finish")
        if sink.error is not None:
            raise sink.error


def run_served_decode(engine: Engine, batch: int, context: int, steps: int = 20, warmup: int = 3, seed: int = 0) -> float:
    """Milliseconds per decode step of ``batch`` requests of ``context`` tokens served through an
    ``EngineLoop`` (median over the requests of their time per token after ``warmup`` tokens).

    The engine must be idle; its prefix cache is cleared afterwards (the loop is shut down, and the
    engine is free for the caller again).
    """
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(max(0, context - OWN_TOKENS))]
    # Room for the arrivals' steps: the first request decodes while the others are added.
    params = SamplingParams(max_tokens=warmup + steps + 2 * batch + 1, ignore_eos=True)
    loop = EngineLoop(engine, name="phloem-bench-served")
    loop.start()
    try:
        if shared:
            _wait([_submit(loop, shared, SamplingParams(max_tokens=1), prefill_only=True)])
        own = [shared + [rng.randrange(vocab) for _ in range(context - len(shared))] for _ in range(batch)]
        sinks = [_submit(loop, prompt, params) for prompt in own]
        _wait(sinks)
    finally:
        loop.shutdown(_TIMEOUT_S)
        if engine.cache.tree is not None:
            engine.cache.tree.clear()
    start = max(s.times[warmup] for s in sinks)
    end = min(s.times[-1] for s in sinks)
    per_token = [(end - start) / sum(start < t <= end for t in s.times) for s in sinks]
    return 1000 * statistics.median(per_token)
