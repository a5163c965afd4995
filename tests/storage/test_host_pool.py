"""Host tier: bit-exact round trips, exact byte accounting, budget refusal, LRU order."""

from __future__ import annotations

import pytest
import torch

from phloem.storage import HostPool, StorageFull

# Payload of one tiny 10-token segment: kv + conv (model dtype) + ssm (fp32) + token ids (int64).
ELEMS_KV, ELEMS_CONV, ELEMS_SSM, ELEMS_IDS = 2 * 3 * 2 * 4 * 2 * 8, 3 * 12 * 3, 3 * 2 * 8 * 6, 10


def expected_nbytes(model_bytes: int) -> int:
    return (ELEMS_KV + ELEMS_CONV) * model_bytes + ELEMS_SSM * 4 + ELEMS_IDS * 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_round_trip_is_bit_exact(make_segment, assert_bit_exact, dtype) -> None:
    seg = make_segment(dtype=dtype)
    seg.tensors["kv"][0, 0, 0, 0, 0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    pool = HostPool(byte_budget=1 << 20, pin_memory=False)
    pool.put(seg)
    assert_bit_exact(pool.get("seg-1"), seg)
    assert_bit_exact(pool.pop("seg-1"), seg)
    assert pool.get("seg-1") is None


@pytest.mark.parametrize(
    ("dtype", "model_bytes"), [(torch.bfloat16, 2), (torch.float32, 4)], ids=["bf16", "fp32"]
)
def test_byte_accounting_is_exact(make_segment, dtype, model_bytes) -> None:
    one = expected_nbytes(model_bytes)
    pool = HostPool(byte_budget=3 * one, pin_memory=False)
    for i in range(3):
        pool.put(make_segment(segment_id=f"seg-{i}", dtype=dtype, seed=i))
        assert pool.used_bytes == (i + 1) * one
    assert pool.free_bytes == 0 and len(pool) == 3
    assert pool.remove("seg-1") and pool.used_bytes == 2 * one
    assert pool.pop("seg-0") is not None and pool.used_bytes == one
    assert not pool.remove("seg-0") and pool.pop("seg-0") is None and pool.used_bytes == one
    pool.remove("seg-2")
    assert pool.used_bytes == 0 and len(pool) == 0


def test_budget_boundary_and_storage_full(make_segment) -> None:
    one = expected_nbytes(2)
    pool = HostPool(byte_budget=2 * one - 1, pin_memory=False)
    assert pool.can_store(one) and not pool.can_store(2 * one)
    pool.put(make_segment(segment_id="a"))
    assert pool.can_store(one - 1) and not pool.can_store(one)
    with pytest.raises(StorageFull, match=f"needs {one} bytes"):
        pool.put(make_segment(segment_id="b"))
    assert pool.used_bytes == one and pool.segment_ids() == ["a"]
    exact = HostPool(byte_budget=one, pin_memory=False)
    exact.put(make_segment(segment_id="a"))
    assert exact.free_bytes == 0


def test_lru_order_for_demotion(make_segment) -> None:
    pool = HostPool(byte_budget=1 << 20, pin_memory=False)
    assert pool.oldest() is None
    for name in ("a", "b", "c"):
        pool.put(make_segment(segment_id=name))
    pool.get("a")
    assert pool.segment_ids() == ["b", "c", "a"]
    assert pool.oldest().meta.segment_id == "b"
    assert pool.segment_ids() == ["b", "c", "a"], "oldest() must not touch the order"
    pool.pop("b")
    assert pool.oldest().meta.segment_id == "c"


def test_rejects_duplicates_and_bad_budgets(make_segment) -> None:
    pool = HostPool(byte_budget=1 << 20, pin_memory=False)
    pool.put(make_segment())
    with pytest.raises(ValueError, match="already in the pool"):
        pool.put(make_segment())
    with pytest.raises(ValueError, match="byte_budget"):
        HostPool(byte_budget=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_memory_needs_cuda() -> None:
    assert HostPool(byte_budget=0).pin_memory is False
    with pytest.raises(ValueError, match="needs CUDA"):
        HostPool(byte_budget=0, pin_memory=True)
