"""The engine's logits for the next token after a token list, from one fresh forward.

The probe request takes pages and a state slot for the forward and gives them back unpublished,
so it leaves the prefix cache as it found it (tests compare these logits with what the engine
sampled or reported).
"""

from __future__ import annotations

import torch

from phloem.engine import Engine, SamplingParams
from phloem.engine.request import Request
from phloem.engine.scheduler import SchedulerOutput


def next_token_logits(engine: Engine, tokens: list[int]) -> torch.Tensor:
    """``[V]`` logits after ``tokens``, in the engine's dtype."""
    req = Request("probe", list(tokens), SamplingParams(max_tokens=1), arrival_idx=0)
    assert engine.cache.admit(req) and engine.cache.allocate_pages(req, len(tokens))
    try:
        logits = engine.runner.forward_logits(engine.runner.prepare_inputs(SchedulerOutput((req,), (len(tokens),))))
        assert logits is not None
        return logits[0]
    finally:
        engine.cache.release(req, publish=False)
