"""Pools sized from the memory the load left free (GPU): memory the load freed but torch's caching
allocator still holds counts as free. Quantizing at load builds the bf16 weights before their FP8
copies; without the release the freed bf16 bytes read as used and the pools were sized from what
little the driver had left (6 GDN state slots for the 35B-A3B on an H100)."""

from __future__ import annotations

import pytest
import torch

from phloem.engine.cache.memory import plan_pools
from phloem.engine.config import CacheConfig, ModelConfig
from phloem.runtime.model_shapes import SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GIB = 1 << 30


def test_memory_the_load_freed_sizes_the_pools() -> None:
    device = torch.device("cuda")
    mc = ModelConfig.from_dict(SHAPES["tiny"])
    cc = CacheConfig(num_pages=16, memory_fraction=1.0)  # the slots take state_fraction of the budget
    freed = 2 * GIB
    scratch = torch.empty(freed, dtype=torch.uint8, device=device)  # a load's staging, then freed
    del scratch
    stale, _ = torch.cuda.mem_get_info(device)  # the freed bytes are still torch's: not free here
    plan = plan_pools(mc, cc, torch.bfloat16, device)
    slot_budget = plan.num_slots * plan.slot_bytes
    assert slot_budget >= (stale + freed - 256 * (1 << 20)) * cc.state_fraction, (
        f"{slot_budget} bytes of slots from {stale} bytes free and {freed} freed: the freed bytes were not counted")
