"""One process's inference core: the engine, its builder and worker ranks, the scheduler and step
pipeline, the model runner, the models; and four sub-packages:

- ``engine.cache``: request memory: the KV page and GDN state-slot pools, the radix prefix cache,
  the cache manager, pool sizing, the page-list mirrors;
- ``engine.sampling``: the sampling parameters, the logits processors, the grammar backend, the
  sampler;
- ``engine.parallel``: tensor (and expert) parallelism, low level: the group and its
  collectives, the sharded layers, state shards, the one-shot all-reduce (the worker ranks an
  engine with ``tensor_parallel_size > 1`` spawns are ``engine.workers``, beside the builder);
- ``engine.transfer``: moving KV pages and GDN state between engines: prefix export/import
  (session spill), prefill/decode disaggregation's messages, transport and pool side.

Inside the engine a module imports only modules of a lower concept, in this order (top first;
import-linter's engine layers contract in pyproject.toml checks it)::

    engine, warmup > build > workers, prefix_ops > step_pipeline, step_outputs, transfer > model_runner, loader
    > scheduler, cuda_graph, prefill_graph, request_checks > cache, sampling > request > models
    > parallel > forward_batch, step_plan, host_copy, progress_bars > config, errors

Public entry point (outside code relies on exactly this shape)::

    from phloem.engine import Engine, EngineConfig, SamplingParams
    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    engine = Engine.from_pretrained(path, EngineConfig(cache=CacheConfig(num_pages=512)), device="cuda")
    outputs = engine.generate(prompt_token_ids, SamplingParams(max_tokens=32))

The public API is the names exported here, ``engine.config``, and the exports of
``engine.transfer`` and ``engine.parallel``; the layers above import nothing else of the engine
(an import-linter contract in pyproject.toml checks it). The configuration, the errors,
``SamplingParams``, the progress bars and ``estimate_memory`` import without torch (the CLI
builds an ``EngineConfig`` before torch loads); ``Engine`` and the output types load on first access.

May import: ``phloem.kernels`` (and torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports
from phloem.engine.config import (
    CacheConfig,
    EngineConfig,
    GrammarConfig,
    KernelConfig,
    LoadConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from phloem.engine.errors import CapacityExceeded, CorruptStep, EngineError, InvalidRequest
from phloem.engine.progress_bars import progress, progress_bar, progress_shown
from phloem.engine.sampling.params import GrammarSpec, SamplingParams

if TYPE_CHECKING:
    from phloem.engine.cache.manager import CacheStats
    from phloem.engine.cache.radix import RadixNode
    from phloem.engine.cache.sizing import WEIGHT_FORMATS, MemoryEstimate, estimate_memory
    from phloem.engine.engine import Engine
    from phloem.engine.request import MemoryWait, RequestOutput, TokenLogprob
    from phloem.engine.sampling.grammar import GrammarStats
    from phloem.engine.speculative import SpeculationStats
    from phloem.engine.warmup import WarmupReport

__all__ = [
    "CacheConfig", "CacheStats", "CapacityExceeded", "CorruptStep", "Engine", "EngineConfig", "EngineError",
    "GrammarConfig", "GrammarSpec", "GrammarStats", "InvalidRequest", "KernelConfig", "LoadConfig", "MemoryEstimate",
    "MemoryWait",
    "ParallelConfig", "RadixNode", "RequestOutput", "RunnerConfig", "SamplingParams", "SchedulerConfig",
    "SpeculationStats", "TokenLogprob", "WEIGHT_FORMATS", "WarmupReport", "estimate_memory", "progress", "progress_bar", "progress_shown",
]

_LAZY = {
    "CacheStats": "phloem.engine.cache.manager",
    "Engine": "phloem.engine.engine",
    "GrammarStats": "phloem.engine.sampling.grammar",
    "MemoryEstimate": "phloem.engine.cache.sizing",
    "MemoryWait": "phloem.engine.request",
    "RadixNode": "phloem.engine.cache.radix",
    "RequestOutput": "phloem.engine.request",
    "SpeculationStats": "phloem.engine.speculative",
    "TokenLogprob": "phloem.engine.request",
    "WEIGHT_FORMATS": "phloem.engine.cache.sizing",
    "WarmupReport": "phloem.engine.warmup",
    "estimate_memory": "phloem.engine.cache.sizing",
}


__getattr__ = lazy_exports(__name__, _LAZY)
