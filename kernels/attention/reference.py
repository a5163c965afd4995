"""Paged KV store and causal attention over it (varlen, GQA), the reference for FlashInfer / Triton.

KV cache layout (FlashInfer NHD paged): ``kv_cache`` ``[num_pages, 2, page_size, Hkv, D]``, index 0 of
dim 1 is K and 1 is V. Token ``t`` of the step lives at page ``slot_mapping[t] // page_size``, offset
``slot_mapping[t] % page_size``. ``page_table[i, j]`` is the page of positions
``j*page_size ... (j+1)*page_size - 1`` of sequence ``i``.

Sequence ``i`` owns query rows ``query_start_loc[i] : query_start_loc[i+1]`` (``query_len`` rows) and has
``seq_lens[i]`` keys; its queries are the last ``query_len`` positions::

    keys:     0 ............................................. seq_len - 1
    queries:                      seq_len - query_len ........ seq_len - 1
    query at position p attends to keys 0..p

GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Scores, softmax and the weighted sum run in
fp32; the output is cast to ``q.dtype``. FP8 pages (``float8_e4m3fn``, unit scale) are written with
a saturating cast and read by the same upcast to fp32.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "paged_attention", "store_kv", "to_kv_dtype"]

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV page of ``dtype`` holds it: fp8 (unit scale) saturates at +-448 instead of
    overflowing to NaN; any other dtype is a plain cast."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes ``k``, ``v`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` ``[T]`` (an exact
    copy, or with fp8 pages the saturating cast of ``to_kv_dtype``)."""
    page_size = kv_cache.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    kv_cache[page, 0, offset] = to_kv_dtype(k, kv_cache.dtype)
    kv_cache[page, 1, offset] = to_kv_dtype(v, kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, pages: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pages`` ``[num_pages_i]`` -> K and V ``[seq_len, Hkv, D]``."""
    kv = kv_cache[pages.long()]  # [num_pages_i, 2, page_size, Hkv, D]
    flat = kv.transpose(0, 1).flatten(1, 2)  # [2, num_pages_i * page_size, Hkv, D]
    return flat[0, :seq_len], flat[1, :seq_len]


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of varlen ``q`` ``[T, Hq, D]`` over paged KV: ``[T, Hq, D]`` in ``q.dtype``."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        query_len = end - start
        num_pages = -(-seq_len // page_size)
        k, v = _gather_kv(kv_cache, page_table[i, :num_pages], seq_len)
        qi = q[start:end].float().view(query_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qi, k.float()) * scale  # [Hkv, G, query_len, seq_len]
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        oi = torch.einsum("hgqk,khd->qhgd", probs, v.float())
        out[start:end] = oi.reshape(query_len, num_q_heads, head_dim).to(q.dtype)
    return out
