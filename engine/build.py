"""What ``Engine.from_pretrained`` builds before the engine itself: the model config, the
tensor-parallel workers, this rank's weights and the grammar backend, on a decided device.

The device is pinned to an index (``cuda`` -> ``cuda:<current>``) so the engine stays on the GPU
it was built on whatever thread runs it later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from phloem.engine.config import EngineConfig, ModelConfig
from phloem.engine.loader import load_model
from phloem.engine.model_runner import CausalLM
from phloem.engine.parallel.group import check_tp_size
from phloem.engine.sampling.grammar import GrammarBackend
from phloem.engine.workers import TPWorkers, WorkerSpec, rank_device

__all__ = ["EngineParts", "bind_cuda_device", "load_parts"]


@dataclass(frozen=True, slots=True)
class EngineParts:
    """The loaded pieces of an engine, and the config they were loaded with (device decided)."""

    config: EngineConfig
    model_config: ModelConfig
    model: CausalLM
    device: torch.device
    dtype: torch.dtype
    workers: TPWorkers | None
    grammar: GrammarBackend


def load_parts(path: str | Path, config: EngineConfig) -> EngineParts:
    """Read the model folder, start the worker ranks (tensor parallelism) and load the weights.

    Raises:
        ValueError: a bad model folder or checkpoint; a tensor-parallel size that does not divide
            the heads or exceeds the visible GPUs.
        EngineError: a tensor-parallel worker failed to start.
    """
    device = _with_index(torch.device(config.load.device))
    model_config = ModelConfig.from_pretrained(path)
    parallel = config.parallel
    check_tp_size(model_config, parallel.tensor_parallel_size, device, parallel.expert_parallel)
    workers = None
    if parallel.tensor_parallel_size > 1:
        device = rank_device(device, 0)
    config = replace(config, load=replace(config.load, device=str(device)))
    if parallel.tensor_parallel_size > 1:
        spec = WorkerSpec(
            str(path), model_config, config.load, config.cache, config.runner, parallel.tensor_parallel_size,
            torch.get_num_threads(), parallel.expert_parallel, kernels=config.kernels,
            speculative=config.speculative,
        )
        workers = TPWorkers.launch(spec)
    try:
        bind_cuda_device(device)
        model = load_model(Path(path), model_config, config.load, workers.group if workers else None,
                           kernels=config.kernels, speculative=config.speculative)
        if workers is not None:
            workers.wait_ready()
        dtype = next(model.parameters()).dtype
        grammar = GrammarBackend(path, model_config.vocab_size, model_config.eos_token_ids, config.grammar)
    except BaseException:
        if workers is not None:
            workers.close()
        raise
    return EngineParts(config, model_config, model, device, dtype, workers, grammar)


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current device>`` (``torch.cuda.set_device`` refuses a device without an
    index). Without CUDA the device is left as given, for the clear errors of the checks that follow."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def bind_cuda_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(_with_index(device))
