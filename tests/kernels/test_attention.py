from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from phloem.kernels.attention.reference import paged_attention, store_kv

PAGE_SIZE = 16
HEAD_DIM = 24
DTYPES = [torch.float32, torch.bfloat16]

# (seq_lens, query_lens): page boundaries 15/16/17 for decode and prefill, chunks with history, mixed.
ATTN_CASES = {
    "single_token": ([1], [1]),
    "decode_page_edges": ([15, 16, 17], [1, 1, 1]),
    "prefill_page_edges": ([15, 16, 17], [15, 16, 17]),
    "chunk_with_history": ([33, 17], [10, 16]),
    "mixed": ([40, 1, 16, 17], [40, 1, 3, 1]),
}
HEADS = {"mha_1x1": (1, 1), "gqa_4x2": (4, 2), "gqa_6x1": (6, 1)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 37], ids=["T1", "T37"])
def test_store_kv_exact(assert_close, num_tokens, dtype) -> None:
    torch.manual_seed(0)
    num_pages, num_kv_heads = 5, 3
    kv_cache = torch.randn(num_pages, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, HEAD_DIM).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, HEAD_DIM).to(dtype)
    slot_mapping = torch.randperm(num_pages * PAGE_SIZE)[:num_tokens]
    expected = kv_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        expected[slot // PAGE_SIZE, 0, slot % PAGE_SIZE] = k[t]
        expected[slot // PAGE_SIZE, 1, slot % PAGE_SIZE] = v[t]
    store_kv(k, v, kv_cache, slot_mapping)
    assert_close(kv_cache, expected, exact=True)


def _build_batch(seq_lens: list[int], query_lens: list[int], num_q_heads: int, num_kv_heads: int, dtype):
    """Random K/V stored on shuffled pages; returns per-sequence dense tensors and the paged batch."""
    torch.manual_seed(sum(seq_lens) * 31 + num_q_heads)
    pages_per_seq = [-(-n // PAGE_SIZE) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages).tolist()
    # Unused entries point past the cache, so any read beyond seq_len's pages raises.
    page_table = torch.full((len(seq_lens), max(pages_per_seq)), num_pages, dtype=torch.int32)
    kv_cache = torch.empty(num_pages, 2, PAGE_SIZE, num_kv_heads, HEAD_DIM, dtype=dtype)  # NaN-filled by conftest
    dense, qs = [], []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        page_table[i, : pages_per_seq[i]] = torch.tensor(order[: pages_per_seq[i]], dtype=torch.int32)
        order = order[pages_per_seq[i] :]
        k, v = (torch.randn(seq_len, num_kv_heads, HEAD_DIM).to(dtype) for _ in range(2))
        pos = torch.arange(seq_len)
        store_kv(k, v, kv_cache, page_table[i, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE)
        qs.append(torch.randn(query_len, num_q_heads, HEAD_DIM).to(dtype))
        dense.append((qs[-1], k, v))
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return dense, torch.cat(qs), kv_cache, page_table, query_start_loc, seq_lens_t


def _sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense causal attention of the last ``len(q)`` positions, fp64, GQA by repeating KV heads."""
    query_len, seq_len, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q64, k64, v64 = (x.double().transpose(0, 1) for x in (q, k, v))
    mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
    out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(q.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("case", list(ATTN_CASES), ids=list(ATTN_CASES))
def test_paged_attention_matches_dense_sdpa(assert_close, case, heads, dtype) -> None:
    seq_lens, query_lens = ATTN_CASES[case]
    num_q_heads, num_kv_heads = HEADS[heads]
    scale = HEAD_DIM**-0.5
    dense, q, kv_cache, page_table, query_start_loc, seq_lens_t = _build_batch(
        seq_lens, query_lens, num_q_heads, num_kv_heads, dtype
    )
    out = paged_attention(q, kv_cache, page_table, query_start_loc, seq_lens_t, scale)
    for i, (qi, ki, vi) in enumerate(dense):
        s = slice(query_start_loc[i], query_start_loc[i + 1])
        assert_close(out[s], _sdpa_reference(qi, ki, vi, scale), msg=f"sequence {i}")
        alone_loc = torch.tensor([0, len(qi)], dtype=torch.int32)
        single = paged_attention(qi, kv_cache, page_table[i : i + 1], alone_loc, seq_lens_t[i : i + 1], scale)
        assert_close(out[s], single, exact=True, msg=f"varlen vs alone, sequence {i}")
