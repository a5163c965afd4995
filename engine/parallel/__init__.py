"""Tensor (and expert) parallelism, low level: the group, the sharded layers, state shards, all-reduce.

Modules::

    group               ``TPGroup``: one rank's view of the group and its collectives; the
                        sharding table; ``check_tp_size``, ``kv_head_start``
    layers              the sharded layers (vocab-parallel embedding and LM head, row-parallel
                        linear) and ``Shard``, the part of a checkpoint tensor a rank reads
    state_shards        a prefix's KV pages and GDN state gathered from / scattered to the ranks
                        (exported state is always in the TP=1 layout)
    one_shot_allreduce  NVLink buffers every GPU of the group has mapped, for the one-shot
                        all-reduce + add + RMSNorm kernel (opt-in: ``KernelConfig``)
    cuda_ipc            the CUDA runtime calls (ctypes) that map a buffer into the peers
    simulated           a stand-in backend for one rank alone: collectives as local copies,
                        counted (``bench decode --simulate-tp``)

The worker ranks (spawning them, the loop that builds a model runner and replays step plans) are
not here: they build a whole rank, so they sit beside the builder, in ``engine.workers``.

The names below load on first access, so a module that needs one part (the models import
``group`` and ``layers``) does not load the others.

May import: ``engine.config`` and ``engine.forward_batch`` (the engine's lowest layers),
``phloem.kernels`` (and torch); nothing above them: not the models, the cache, the runner,
``engine.transfer`` or ``engine.workers`` (import-linter's engine layers contract checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports

if TYPE_CHECKING:
    from phloem.engine.parallel.group import TPGroup, check_tp_size, kv_head_start
    from phloem.engine.parallel.layers import Shard

__all__ = ["Shard", "TPGroup", "check_tp_size", "kv_head_start"]

_LAZY = {
    "Shard": "phloem.engine.parallel.layers",
    "TPGroup": "phloem.engine.parallel.group",
    "check_tp_size": "phloem.engine.parallel.group",
    "kv_head_start": "phloem.engine.parallel.group",
}


__getattr__ = lazy_exports(__name__, _LAZY)
