"""Sizing the KV page pool and the GDN state slot pool from the memory left after weights.

One page holds ``page_size`` tokens of K and V for every full-attention layer; one slot holds the
fp32 recurrent state and the conv state of every GDN layer. The pool budget (free device memory
after weights × ``memory_fraction``; on CPU ``cpu_pool_bytes``) is split by ``state_fraction``.
For Qwen3.5-35B-A3B a slot weighs about as much as 3,000 tokens of KV, so slots are few and
precious: the radix cache keeps checkpoints deliberately. The arithmetic is ``engine.cache.sizing``
(torch-free), which also estimates a model's memory without loading it (``phloem estimate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phloem.engine.cache.sizing import kv_page_bytes, split_budget, state_slot_bytes
from phloem.engine.config import CacheConfig, ModelConfig
from phloem.engine.forward_batch import ModelCaches

__all__ = ["PoolPlan", "allocate_caches", "free_device_bytes", "kv_dtype", "plan_pools"]


@dataclass(frozen=True, slots=True)
class PoolPlan:
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int


def kv_dtype(cc: CacheConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV pages' dtype for a model computing in ``dtype``: its own, or ``float8_e4m3fn``."""
    return torch.float8_e4m3fn if cc.kv_cache_dtype == "fp8_e4m3" else dtype


def _page_bytes(mc: ModelConfig, page_size: int, dtype: torch.dtype, tp_size: int) -> int:
    return kv_page_bytes(mc, page_size, dtype.itemsize, tp_size)


def _slot_bytes(mc: ModelConfig, dtype: torch.dtype, tp_size: int) -> int:
    return state_slot_bytes(mc, dtype.itemsize, tp_size)


def free_device_bytes(device: torch.device) -> int:
    """Device memory free for the pools: what the driver reports free once torch's caching
    allocator has returned its unused blocks.

    Why the release: what the load freed stays reserved by torch and reads as used. Quantizing at
    load (``LoadConfig.quantization="fp8"``) builds the bf16 weights before their FP8 copies, so
    without it the 35B-A3B's freed 64 GiB of bf16 weights read as used and an H100's pools were
    sized from ~2 GiB: 6 state slots, so at most a few requests ran at once however many pages
    were asked for."""
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return free


def plan_pools(
    mc: ModelConfig, cc: CacheConfig, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
    extra_kv_layers: int = 0,
) -> PoolPlan:
    """Decide pool sizes: explicit sizes from ``cc`` win, otherwise split the memory budget.
    ``extra_kv_layers``: full-attention KV layers past the trunk's in every page (the MTP layer's,
    ``engine.models.mtp.mtp_kv_layers``)."""
    trunk = len(mc.full_attention_layers)
    page_bytes = _page_bytes(mc, cc.page_size, kv_dtype(cc, dtype), tp_size)
    if trunk and extra_kv_layers:
        page_bytes = page_bytes // trunk * (trunk + extra_kv_layers)
    page_bytes = max(1, page_bytes)
    slot_bytes = max(1, _slot_bytes(mc, dtype, tp_size))
    if device.type == "cuda":
        budget = int(free_device_bytes(device) * cc.memory_fraction)
    else:
        budget = cc.cpu_pool_bytes
    num_pages, num_slots = split_budget(budget, cc, page_bytes, slot_bytes)
    if num_slots < 2 or num_pages < 2:
        raise ValueError(
            f"cache: the pool budget of {budget} bytes holds {num_pages} KV pages of {page_bytes} bytes "
            f"and {num_slots} state slots of {slot_bytes} bytes; need at least 2 of each "
            "(raise memory_fraction / cpu_pool_bytes or set num_pages / num_state_slots)"
        )
    return PoolPlan(num_pages, num_slots, page_bytes, slot_bytes)


def allocate_caches(
    mc: ModelConfig, plan: PoolPlan, page_size: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
    extra_kv_layers: int = 0, kv_cache_dtype: torch.dtype | None = None,
) -> ModelCaches:
    """The zeroed pools: KV pages in ``kv_cache_dtype`` (default ``dtype``), conv state in
    ``dtype``, recurrent state in fp32."""
    kv_heads = max(1, mc.num_key_value_heads // tp_size)
    kv = torch.zeros(
        (len(mc.full_attention_layers) + extra_kv_layers, plan.num_pages, 2, page_size, kv_heads, mc.head_dim),
        dtype=kv_cache_dtype or dtype,
        device=device,
    )
    conv = torch.zeros(
        (len(mc.linear_attention_layers), plan.num_slots, mc.conv_dim // tp_size, mc.linear_conv_kernel_dim - 1),
        dtype=dtype,
        device=device,
    )
    ssm = torch.zeros(
        (
            len(mc.linear_attention_layers),
            plan.num_slots,
            mc.linear_num_value_heads // tp_size,
            mc.linear_key_head_dim,
            mc.linear_value_head_dim,
        ),
        dtype=torch.float32,
        device=device,
    )
    return ModelCaches(kv=kv, conv=conv, ssm=ssm)
