"""One process's inference core: models, weight loading, KV pages, GDN state slots, scheduler,
model runner, sampler; tensor parallelism (``parallel``: group, sharded layers, shard specs;
``tp_workers``: the worker ranks an engine with ``tensor_parallel_size > 1`` spawns).

Public entry point (outside code relies on exactly this shape)::

    from phloem.engine import Engine, EngineConfig, SamplingParams
    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    engine = Engine.from_pretrained(path, EngineConfig(cache=CacheConfig(num_pages=512)), device="cuda")
    outputs = engine.generate(prompt_token_ids, SamplingParams(max_tokens=32))

The configuration, the errors and ``SamplingParams`` import without torch (the CLI builds an
``EngineConfig`` before torch loads); ``Engine`` and the output types load on first access.

May import: ``phloem.kernels`` (and torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from phloem.engine.config import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LoadConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from phloem.engine.errors import CapacityExceeded, CorruptStep, EngineError, InvalidRequest
from phloem.engine.sampling_params import GrammarSpec, SamplingParams

if TYPE_CHECKING:
    from phloem.engine.engine import Engine
    from phloem.engine.request import RequestOutput, TokenLogprob

__all__ = [
    "CacheConfig", "CapacityExceeded", "CorruptStep", "Engine", "EngineConfig", "EngineError", "GrammarSpec",
    "InvalidRequest", "KernelConfig", "LoadConfig", "ParallelConfig", "RequestOutput", "RunnerConfig",
    "SamplingParams", "SchedulerConfig", "TokenLogprob",
]

_LAZY = {
    "Engine": "phloem.engine.engine",
    "RequestOutput": "phloem.engine.request",
    "TokenLogprob": "phloem.engine.request",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phloem.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
