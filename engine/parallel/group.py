"""Tensor parallelism: the group context and its collectives; how each module is sharded.

The sharded layers and the shard specs the loader reads are in ``engine.parallel.layers``.

Every rank builds the same model with per-rank sizes and runs the same forward (SPMD). The group
is passed explicitly to whatever communicates; ``TPGroup.single()`` (TP=1) has no process group
and every collective returns its input untouched, so TP=1 costs nothing.

Sharding of rank ``r`` of ``N`` (a weight is ``[out, in]``; "rows" are outputs)::

    attention  q heads split (q_proj rows, per head [query | gate]); KV heads split when
               Hkv % N == 0, else replicated: each rank keeps the one KV head its q heads read
               (N % Hkv == 0); o_proj split by input columns, then all-reduce
    GDN        key and value heads split: the q, k and v parts of in_proj / conv by heads;
               z, b, a, A_log and dt_bias by value heads; out_proj by input columns, all-reduce
    MLP, MoE   every FFN's intermediate split (each expert, and the shared expert E):
               gate/up rows, down_proj input columns, then all-reduce; the router is replicated.
               With ``expert_parallel`` rank r instead holds routed experts [r*E/N, (r+1)*E/N)
               whole and rank 0 the whole shared expert; each rank adds its experts' share
               of every token, then all-reduce. A shared expert of another FFN size than the
               experts' is its own MLP, split like a dense one under both
    embedding  vocab rows split, padded to ceil(V / N) per rank; a token outside a rank's rows
               embeds to 0 there, then all-reduce (exactly one rank contributes: exact)
    LM head    vocab rows split; logits gathered to rank 0, the only rank that samples
    replicated every norm weight (the GDN gated norm is [Dv], shared by all heads), q/k norms

Every "then all-reduce" above is deferred: those modules return this rank's partial sum, and the
RMSNorm that reads it next reduces it together with the residual add and the norm
(``TPGroup.all_reduce_add_rms_norm``: one NVLink kernel per call at decode sizes on GPUs, see
``engine.parallel.one_shot_allreduce``, opt-in; the process group's all-reduce otherwise). A layer pays two.
On the fused one-token path the norm is the prologue of the projection after it, so the
reduction comes first and hands that projection its operands (``TPGroup.reduce_norm_operands``).

A group with ``pg=None`` and ``size > 1`` builds or loads one rank's shard in a single process
(tests); it must not communicate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phloem.engine.config import ModelConfig
from phloem.kernels.config import KernelConfig
from phloem.engine.parallel.one_shot_allreduce import OneShotAllReduce

Op = Callable[..., Any]
# Moved between ranks as bytes: gloo has no fp8 types (fp8 KV pages, ``CacheConfig.kv_cache_dtype``).
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

__all__ = ["TPGroup", "check_tp_size", "kv_head_start"]

@dataclass(frozen=True, slots=True, eq=False)
class TPGroup:
    """One rank's view of its tensor-parallel group; ``pg`` is None at TP=1 (and in shard-only tests)."""

    rank: int
    size: int
    device: torch.device
    pg: Any = None  # a gloo or NCCL c10d backend
    expert_parallel: bool = False  # routed experts split whole across the ranks (``engine.models._moe``)
    one_shot: OneShotAllReduce | None = None  # NVLink buffers for small all-reduces (``engine.parallel.one_shot_allreduce``)

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside a group of {self.size}"

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TPGroup:
        return cls(0, 1, torch.device(device))

    @classmethod
    def connect(
        cls, rank: int, size: int, store: Any, device: torch.device, timeout: timedelta, expert_parallel: bool = False,
        kernels: KernelConfig = KernelConfig(),
    ) -> TPGroup:
        """Join the group through a c10d store: NCCL on CUDA, gloo otherwise (blocks until all ranks join).
        On GPUs, with ``kernels.one_shot_allreduce`` (the same on every rank), also the one-shot
        NVLink all-reduce (``engine.parallel.one_shot_allreduce``), under PDL as ``kernels.pdl`` says."""
        prefixed = dist.PrefixStore("phloem-tp", store)  # type: ignore[attr-defined]
        if device.type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL")
            options = nccl.Options()
            options._timeout = timeout
            options.is_high_priority_stream = False
            pg = nccl(prefixed, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        group = cls(rank, size, device, pg, expert_parallel)
        if device.type != "cuda":
            return group
        pdl = False
        if kernels.one_shot_allreduce:
            from phloem.kernels.common.pdl import use_pdl  # imports triton, which the kernel needs anyway

            pdl = use_pdl(kernels.pdl, device)
        one_shot = OneShotAllReduce.connect(
            rank, size, device, dist.PrefixStore("phloem-one-shot", store),  # type: ignore[attr-defined]
            lambda ok: group.all_min([int(ok)])[0] == 1, group.all_reduce, kernels.one_shot_allreduce, pdl,
        )  # fmt: skip
        return replace(group, one_shot=one_shot)

    def shutdown(self) -> None:
        """Release the process group (NCCL wants it before its peers exit); no collective after."""
        if self.one_shot is not None:
            self.one_shot.close()
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            self.pg.shutdown()

    def _backend(self) -> Any:
        assert self.pg is not None, f"rank {self.rank} of {self.size}: a shard-only group cannot communicate"
        return self.pg

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same values."""
        if self.size == 1:
            return x
        self._backend().allreduce([x]).wait()
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, add_rms_norm: Op
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(all_reduce(x), residual, weight, eps)``: the sum of the ranks' partial ``x``,
        added to the residual stream and normalised; every rank gets the same values.

        One kernel through ``one_shot`` where the group has it and the call fits (decode sizes on
        GPUs with peer access), else the process group's all-reduce then ``add_rms_norm`` (the op
        table's, the same numerics for two ranks). ``x`` may be overwritten (reduced in place).
        """
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot.add_rms_norm(x, residual, weight, eps)
            x = self.all_reduce(x)
        out: tuple[torch.Tensor, torch.Tensor] = add_rms_norm(x, residual, weight, eps)
        return out

    def reduce_norm_operands(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x', residual')`` with ``add_rms_norm(x', residual', weight, eps)`` equal to
        ``all_reduce_add_rms_norm(x, residual, weight, eps, add_rms_norm)``: the operands of an op
        that runs the add + norm as its own prologue (the fused one-token projections,
        ``kernels.linear.reference``), so under TP the all-reduce goes in front of it and every
        fusion stays. Every rank gets the same values.

        TP=1: ``(x, residual)``. Through ``one_shot`` (where it fits): the reduced residual sum and
        None (the kernel's normed output is not read; the op's prologue normalises the sum again,
        with the same formula). Else: the process group's sum of ``x`` (in place) and ``residual``.
        """
        if self.size == 1:
            return x, residual
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.add_rms_norm(x, residual, weight, eps)[1], None
        return self.all_reduce(x), residual

    def gather_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along ``dim`` on rank 0; None on the other ranks."""
        if self.size == 1:
            return x
        parts = self.gather_list(x)
        return None if parts is None else torch.cat(parts, dim)

    def gather_list(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype on all ranks), in rank order, on rank 0; None elsewhere."""
        if self.size == 1:
            return [x]
        if x.dtype in _FP8:
            parts = self.gather_list(x.view(torch.uint8))
            return None if parts is None else [p.view(x.dtype) for p in parts]
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._backend().gather([], [x], options).wait()
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._backend().gather([parts], [x], options).wait()
        return parts

    def scatter_from_first(self, out: torch.Tensor, parts: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Rank ``r`` receives ``parts[r]`` (given on rank 0 only, each shaped like ``out``) into ``out``."""
        if self.size == 1:
            assert parts is not None
            return out.copy_(parts[0])
        if out.dtype in _FP8:
            as_bytes = None if parts is None else [p.contiguous().view(torch.uint8) for p in parts]
            self.scatter_from_first(out.view(torch.uint8), as_bytes)
            return out
        options = dist.ScatterOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._backend().scatter([out], [], options).wait()
            return out
        assert parts is not None and len(parts) == self.size, "rank 0 scatters one part per rank"
        self._backend().scatter([out], [[p.contiguous() for p in parts]], options).wait()
        return out

    def broadcast_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere), in place."""
        if self.size == 1:
            return x
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._backend().broadcast([x], options).wait()
        return x

    def all_min(self, values: Sequence[int]) -> list[int]:
        """Element-wise minimum of small integer lists over the ranks (e.g. pool sizes)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._backend().allreduce([t], options).wait()
        return [int(v) for v in t.tolist()]


def kv_head_start(num_heads: int, num_kv_heads: int, tp: TPGroup) -> int:
    """First KV head of this rank: its own share when KV heads split, else the one its q heads read."""
    if num_kv_heads % tp.size == 0:
        return tp.rank * (num_kv_heads // tp.size)
    q_start = tp.rank * (num_heads // tp.size)
    return q_start // (num_heads // num_kv_heads)


def check_tp_size(mc: ModelConfig, tp_size: int, device: torch.device, expert_parallel: bool = False) -> None:
    """Raise ``ValueError`` unless ``tp_size`` ranks (1..8: ``ParallelConfig``) can shard ``mc`` on ``device``
    (experts split whole across the ranks with ``expert_parallel``)."""
    if tp_size == 1:
        return
    moe = [mc.is_moe_layer(i) for i in range(mc.num_hidden_layers)]
    if expert_parallel and not any(moe):
        raise ValueError(f"expert_parallel: {mc.architecture} has no MoE layers to split")
    must_divide = {
        "num_attention_heads": mc.num_attention_heads,
        "linear_num_key_heads": mc.linear_num_key_heads,
        "linear_num_value_heads": mc.linear_num_value_heads,
        # Only the FFN sizes some layer uses: whole experts under expert parallelism.
        "intermediate_size": mc.intermediate_size if not all(moe) else 0,
        "moe_intermediate_size": mc.moe_intermediate_size if any(moe) and not expert_parallel else 0,
        "num_experts": mc.num_experts if expert_parallel else 0,
        # A shared expert of its own size is split across the ranks under TP and EP alike.
        "shared_expert_intermediate_size": (mc.shared_expert_intermediate_size if any(moe) and (
            mc.shared_expert_intermediate_size != mc.moe_intermediate_size) else 0),
    }
    for name, value in must_divide.items():
        if value % tp_size:
            raise ValueError(f"tensor_parallel_size: expected a divisor of {name}={value}, got {tp_size}")
    kv = mc.num_key_value_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(
            f"tensor_parallel_size: expected a divisor or a multiple of num_key_value_heads={kv} "
            f"(KV heads split or replicated), got {tp_size}"
        )
    if device.type == "cuda":
        first = device.index or 0
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if first + tp_size > visible:
            raise ValueError(
                f"tensor_parallel_size: {tp_size} ranks from {device} need GPUs {first}..{first + tp_size - 1}, "
                f"but {visible} are visible"
            )
