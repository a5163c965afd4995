"""The pinned arena's range bookkeeping, on pageable buffers (the CPU has nothing to pin): a range
is handed out once, comes back only when no tensor, view or numpy array over it is left, merges
with its free neighbours, and an allocation that fits no range is refused and counted."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from phloem.storage import PinnedArena, Segment


def pageable(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def arena(capacity: int = 8192, chunk: int = 4096) -> PinnedArena:
    return PinnedArena(capacity, chunk_bytes=chunk, allocate=pageable)


def released(a: PinnedArena) -> int:
    gc.collect()
    a.collect()
    return a.used_bytes


def small_segment() -> Segment:
    """24 tokens in pages of 4: a 768-byte KV and three smaller tensors, all pageable."""
    return Segment.from_tensors(
        session_id="s", segment_id="g", model_fingerprint="f",
        tensors={"kv": torch.randn(1, 6, 2, 4, 1, 8).to(torch.bfloat16),
                 "conv": torch.randn(1, 6, 3).to(torch.bfloat16),
                 "ssm": torch.randn(1, 1, 8, 8), "token_ids": torch.arange(24)})


def test_capacity_is_pinned_in_chunks_and_allocations_are_disjoint() -> None:
    a = arena(capacity=10_000, chunk=4096)
    assert a.pinned_bytes == 10_000  # 4096 + 4096 + 1808
    x = a.alloc((3, 100), torch.float32)
    y = a.alloc((50,), torch.bfloat16)
    assert x is not None and y is not None
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((3, 100), torch.float32, (50,), torch.bfloat16)
    base = a._chunks[0].buffer.data_ptr()
    assert (x.data_ptr() - base) % 512 == 0 and (y.data_ptr() - base) % 512 == 0
    x.fill_(1.5)
    y.fill_(-2.0)
    assert bool((x == 1.5).all()) and bool((y == -2.0).all())  # neither write reached the other
    assert a.used_bytes == 1536 + 512  # 1,200 and 100 bytes, each rounded up to 512


def test_a_range_comes_back_only_when_its_last_view_goes() -> None:
    a = arena()
    x = a.alloc((256,), torch.float32)
    assert x is not None
    ptr = x.data_ptr()
    view, array = x[10:], x.view(torch.int32).numpy()
    del x
    assert released(a) == 1024
    del view
    assert released(a) == 1024  # the numpy array still reads it
    del array
    assert released(a) == 0
    again = a.alloc((256,), torch.float32)
    assert again is not None and again.data_ptr() == ptr  # first fit reuses it


def test_freed_neighbours_merge_and_a_fragmented_arena_refuses() -> None:
    a = arena(capacity=4096, chunk=4096)
    parts = [a.alloc((1024,), torch.uint8) for _ in range(4)]
    assert all(p is not None for p in parts) and a.alloc((1,), torch.uint8) is None
    assert a.fallbacks == 1
    del parts[0], parts[1]  # the first and third kilobytes: two free ranges of 1 KiB
    assert released(a) == 2048
    assert a.alloc((2048,), torch.uint8) is None  # no 2 KiB run
    assert a.fallbacks == 2
    del parts[0]  # the second kilobyte: the first three merge
    assert released(a) == 1024
    big = a.alloc((3072,), torch.uint8)
    assert big is not None and a.used_bytes == 4096


def test_larger_than_a_chunk_is_refused() -> None:
    a = arena(capacity=8192, chunk=4096)
    assert a.alloc((4097,), torch.uint8) is None
    assert a.fallbacks == 1 and a.used_bytes == 0


def test_a_range_dropped_on_another_thread_comes_back() -> None:
    a = arena()
    box = [a.alloc((1000,), torch.uint8)]
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert released(a) == 0


def test_pinning_that_fails_part_way_keeps_the_chunks_pinned(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def flaky(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: out of memory")
        return pageable(nbytes)

    a = PinnedArena(8192, chunk_bytes=4096, allocate=flaky)
    assert a.pinned_bytes == 4096 and len(calls) == 2
    assert "pinned 4096 of 8192 bytes" in caplog.text
    assert a.alloc((4096,), torch.uint8) is not None


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_sizes_must_be_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        PinnedArena(bad, allocate=pageable)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        PinnedArena(4096, chunk_bytes=bad, allocate=pageable)  # type: ignore[arg-type]


def test_a_segment_brought_on_host_takes_arena_ranges() -> None:
    a = arena(capacity=1 << 20, chunk=1 << 20)
    segment = small_segment()
    base = a._chunks[0].buffer.data_ptr()
    # pinned=True asks for page-locked copies; pageable CPU tensors are not, so each is copied
    # into the arena (here its pageable stand-in), none allocated elsewhere.
    hosted = segment.on_host(pinned=True, alloc=a.alloc)
    for name, t in hosted.tensors.items():
        assert base <= t.data_ptr() < base + (1 << 20), name
        assert torch.equal(t, segment.tensors[name]), name
    assert a.fallbacks == 0
    del hosted, t
    assert released(a) == 0


def test_a_segment_past_a_full_arena_stays_pageable_and_is_not_copied() -> None:
    """What fits takes a range; a tensor no range holds keeps its pageable memory, the same
    tensor, not a copy and never a fresh pinned block (pinning stalls the running steps)."""
    a = arena(capacity=1024, chunk=1024)
    segment = small_segment()  # its KV: 768 bytes, a 1024-byte range, the whole arena
    base = a._chunks[0].buffer.data_ptr()
    hosted = segment.on_host(pinned=True, alloc=a.alloc)
    inside = {name for name, t in hosted.tensors.items() if base <= t.data_ptr() < base + 1024}
    assert inside == {"kv"}
    for name in ("conv", "ssm", "token_ids"):
        assert hosted.tensors[name] is segment.tensors[name]
    assert a.fallbacks == 3
    assert all(torch.equal(hosted.tensors[n], segment.tensors[n]) for n in segment.tensors)
