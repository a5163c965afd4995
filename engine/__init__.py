"""One process's inference core: models, weight loading, KV pages, GDN state slots, scheduler,
model runner, sampler; tensor parallelism (``parallel``: group, sharded layers, shard specs;
``tp_workers``: the worker ranks an engine with ``tensor_parallel_size > 1`` spawns).

Public entry point (outside code relies on exactly this shape)::

    from phloem.engine import Engine, SamplingParams
    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    outputs = engine.generate(prompt_token_ids, SamplingParams(max_tokens=32))

May import: ``phloem.kernels`` (and torch).
"""

from phloem.engine.engine import Engine
from phloem.engine.errors import CapacityExceeded, CorruptStep, EngineError, InvalidRequest
from phloem.engine.request import RequestOutput, TokenLogprob
from phloem.engine.sampling_params import GrammarSpec, SamplingParams

__all__ = [
    "CapacityExceeded", "CorruptStep", "Engine", "EngineError", "GrammarSpec", "InvalidRequest", "RequestOutput", "SamplingParams",
    "TokenLogprob",
]
