"""Split-KV paged decode attention (Triton) against the torch reference ``kernels.attention.reference.paged_attention``.

On CPU the kernels run under the Triton interpreter, in fp32 and fp16 (its ``tl.dot`` on bf16
operands is wrong in Triton 3.6: bf16 runs on the GPU only).
"""

from __future__ import annotations

import os

import pytest
import torch
from paged_lists import PageLists

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.attention.reference import paged_attention  # noqa: E402
from phloem.kernels.attention.triton_decode import default_max_splits, paged_decode_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Batch:
    """Random K/V on shuffled pages; the FlashInfer-style indices and the reference's page table."""

    def __init__(self, seq_lens, num_q_heads, num_kv_heads, head_dim, page_size, dtype, extra_pages=0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages) + extra_pages + 1
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        # The last page is NaN, and so is every slot past a sequence's end: reads of them must not count.
        self.kv_cache[-1] = float("nan")
        order = torch.randperm(num_pages - 1, generator=gen).tolist()
        # Entries past nnz point at the NaN page.
        lists = PageLists(seq_lens, page_size, order, num_pages - 1, DEVICE)
        for ids, last in zip(lists.ids, lists.last):
            self.kv_cache[ids[-1], :, last:] = float("nan")
        self.page_table = lists.page_table
        self.kv_indptr, self.kv_indices, self.kv_last_page_len = lists.kv_indptr, lists.kv_indices, lists.kv_last_page_len
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(DEVICE, dtype)
        self.scale = head_dim**-0.5

    def indices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def run(self, max_splits: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode_attention(self.q, self.kv_cache, *self.indices(), self.scale, max_splits, out)

    def reference(self, upcast: bool = False) -> torch.Tensor:
        q, kv = (self.q.float(), self.kv_cache.float()) if upcast else (self.q, self.kv_cache)
        query_start_loc = torch.arange(len(self.seq_lens) + 1, dtype=torch.int32)
        return paged_attention(q, kv, self.page_table.to(DEVICE), query_start_loc, self.seq_lens, self.scale)


# (seq_lens, (Hq, Hkv), head_dim, page_size, max_splits): lengths 1, a page, a page + 1 and several splits.
CASES = {
    "B1-len1-mha-direct": ([1], (2, 2), 32, 4, 1),
    "B3-page-edges-gqa2-direct": ([1, 16, 17], (4, 2), 32, 16, 1),
    "B3-page4-gqa4-3splits": ([4, 5, 37], (4, 1), 32, 4, 3),
    "B1-3splits-ragged-tail": ([70], (2, 2), 16, 4, 3),
    "B3-more-splits-than-needed": ([1, 40, 90], (4, 2), 32, 16, 8),
    "B1-gqa8-default-splits": ([33], (8, 1), 32, 16, None),
}


SLOW_CASES = {"B3-more-splits-than-needed"}  # over ~0.5 s under the Triton interpreter


@pytest.mark.parametrize(("seq_lens", "heads", "head_dim", "page_size", "max_splits"),
                         [pytest.param(*case, marks=pytest.mark.slow) if name in SLOW_CASES else case
                          for name, case in CASES.items()], ids=CASES)
def test_matches_reference_fp32(assert_close, decode_preload, seq_lens, heads, head_dim, page_size, max_splits) -> None:
    batch = Batch(seq_lens, *heads, head_dim, page_size, torch.float32, seed=len(seq_lens) + head_dim)
    assert_close(batch.run(max_splits), batch.reference(), atol=1e-5, rtol=1e-5)


def test_matches_reference_fp16(assert_close, decode_preload) -> None:
    batch = Batch([3, 21], 4, 2, 32, 4, torch.float16, seed=3)
    assert_close(batch.run(2).float(), batch.reference(upcast=True), atol=2e-3, rtol=2e-3)


@pytest.mark.slow  # the Triton interpreter, twice
def test_grid_ignores_lengths_and_writes_out_in_place(assert_close, decode_preload) -> None:
    """One launch shape, index tensors rewritten in place (as a captured graph replays): short and
    long sequences in one batch, then swapped, are both right."""
    short_long = Batch([1, 50], 4, 2, 16, 4, torch.float32, seed=5)
    long_short = Batch([50, 1], 4, 2, 16, 4, torch.float32, seed=6)
    out = torch.empty_like(short_long.q)
    for batch in (short_long, long_short):
        for mine, theirs in zip(short_long.indices(), batch.indices()):
            mine.copy_(theirs)
        short_long.q.copy_(batch.q)
        short_long.kv_cache.copy_(batch.kv_cache)
        got = paged_decode_attention(short_long.q, short_long.kv_cache, *short_long.indices(), batch.scale, 4, out)
        assert got is out
        assert_close(out, batch.reference(), atol=1e-5, rtol=1e-5)


def test_default_max_splits() -> None:
    """H200 (132 SMs), Hkv 2: one wave of ~4 programs per SM, capped at 256 splits, at least one."""
    assert [default_max_splits(b, 2, 132) for b in (1, 4, 16, 64, 4096)] == [256, 64, 16, 4, 1]


def _bad_inputs(case: str) -> dict[str, object]:
    batch = Batch([5, 9], 4, 2, 32, 4, torch.float32)
    args: dict[str, object] = dict(
        q=batch.q, kv_cache=batch.kv_cache, kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
        kv_last_page_len=batch.kv_last_page_len, scale=batch.scale,
    )  # fmt: skip
    kv = batch.kv_cache
    bad = {
        "q-2d": dict(q=batch.q[0]),
        "heads-not-multiple": dict(q=torch.randn(2, 3, 32, device=DEVICE)),
        "head-dim-not-pow2": dict(q=torch.randn(2, 4, 24, device=DEVICE), kv_cache=kv[..., :24]),
        "head-dim-too-large": dict(q=torch.randn(2, 4, 1024, device=DEVICE), kv_cache=kv.new_zeros(4, 2, 4, 2, 1024)),
        "head-dim-mismatch": dict(kv_cache=kv[..., :16]),
        "dtype-mismatch": dict(kv_cache=kv.half()),
        "int-dtype": dict(q=batch.q.to(torch.int32), kv_cache=kv.to(torch.int32)),
        "page-not-pow2": dict(kv_cache=kv.new_zeros(4, 2, 6, 2, 32)),
        "indptr-int64": dict(kv_indptr=batch.kv_indptr.long()),
        "indices-int64": dict(kv_indices=batch.kv_indices.long()),
        "last-page-len-shape": dict(kv_last_page_len=batch.kv_last_page_len[:1]),
        "indptr-shape": dict(kv_indptr=batch.kv_indptr[:2]),
        "max-splits-zero": dict(max_splits=0),
        "out-dtype": dict(out=batch.q.half()),
    }
    return args | bad[case]


BAD_CASES = [
    "q-2d", "heads-not-multiple", "head-dim-not-pow2", "head-dim-too-large", "head-dim-mismatch", "dtype-mismatch",
    "int-dtype", "page-not-pow2", "indptr-int64", "indices-int64", "last-page-len-shape", "indptr-shape",
    "max-splits-zero", "out-dtype",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_inputs_it_does_not_cover(case: str) -> None:
    with pytest.raises(ValueError):
        paged_decode_attention(**_bad_inputs(case))  # type: ignore[arg-type]


# The Qwen3.5-35B-A3B attention shape: 16 query heads, 2 KV heads of 256, pages of 16 tokens.
REAL = dict(num_q_heads=16, num_kv_heads=2, head_dim=256, page_size=16, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("context", [1, 1000, 1024, 33000])
@pytest.mark.parametrize("num_seqs", [1, 4, 16])
def test_matches_reference_real_shape_bf16(assert_close, decode_preload, num_seqs: int, context: int) -> None:
    # Ragged batches: sequence i is 37 * i tokens shorter (at least one).
    seq_lens = [max(1, context - 37 * i) for i in range(num_seqs)]
    batch = Batch(seq_lens, **REAL, seed=num_seqs)
    assert_close(batch.run(None).float(), batch.reference(upcast=True), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_captured_short_replays_long(assert_close, decode_preload) -> None:
    """Captured over sequences of 1-20 tokens, replayed after the index tensors were rewritten in
    place for 1 to 40000 tokens (kv_indices sized for the longest)."""
    long = Batch([40000, 1, 17, 9000], **REAL, seed=1)
    short = Batch([20, 1, 16, 3], **REAL, extra_pages=long.kv_cache.shape[0] - 1 - 5, seed=2)
    assert short.kv_cache.shape == long.kv_cache.shape
    indptr, indices, last = (t.clone() for t in long.indices())
    indices.zero_()
    for mine, theirs in zip((indptr, indices, last), short.indices()):
        mine[: theirs.numel()].copy_(theirs)
    q, kv_cache = short.q.clone(), short.kv_cache.clone()
    out = torch.empty_like(q)
    paged_decode_attention(q, kv_cache, indptr, indices, last, short.scale, None, out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kv_cache, indptr, indices, last, short.scale, None, out)
    graph.replay()
    assert_close(out.float(), short.reference(upcast=True), atol=2e-2, rtol=2e-2, msg="short")
    for mine, theirs in zip((q, kv_cache, indptr, indices, last), (long.q, long.kv_cache, *long.indices())):
        mine.copy_(theirs)
    graph.replay()
    assert_close(out.float(), long.reference(upcast=True), atol=2e-2, rtol=2e-2, msg="long")
