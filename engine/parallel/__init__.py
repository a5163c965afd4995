"""Tensor (and expert) parallelism: the group, the sharded layers, the worker ranks, all-reduce.

Modules::

    group               ``TPGroup``: one rank's view of the group and its collectives; the
                        sharding table; ``check_tp_size``, ``kv_head_start``
    layers              the sharded layers (vocab-parallel embedding and LM head, row-parallel
                        linear) and ``Shard``, the part of a checkpoint tensor a rank reads
    workers             ``TPWorkers``: rank 0 spawns ranks 1..N-1, hands them step plans
    state_shards        a prefix's KV pages and GDN state gathered from / scattered to the ranks
                        (exported state is always in the TP=1 layout)
    one_shot_allreduce  NVLink buffers every GPU of the group has mapped, for the one-shot
                        all-reduce + add + RMSNorm kernel (opt-in: ``KernelConfig``)
    cuda_ipc            the CUDA runtime calls (ctypes) that map a buffer into the peers

The names below load on first access (the workers module imports the model runner, which
imports ``group``).

May import: the engine core (``phloem.engine.*``), ``phloem.kernels`` (and torch); not
``engine.transfer``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phloem.engine.parallel.group import TPGroup, check_tp_size, kv_head_start
    from phloem.engine.parallel.layers import Shard
    from phloem.engine.parallel.workers import TPWorkers, WorkerSpec, rank_device

__all__ = ["Shard", "TPGroup", "TPWorkers", "WorkerSpec", "check_tp_size", "kv_head_start", "rank_device"]

_LAZY = {
    "Shard": "phloem.engine.parallel.layers",
    "TPGroup": "phloem.engine.parallel.group",
    "TPWorkers": "phloem.engine.parallel.workers",
    "WorkerSpec": "phloem.engine.parallel.workers",
    "check_tp_size": "phloem.engine.parallel.group",
    "kv_head_start": "phloem.engine.parallel.group",
    "rank_device": "phloem.engine.parallel.workers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phloem.engine.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
