"""The grouped MoE's block layout (``kernels.moe.triton_grouped``) in one Triton launch.

``sort_by_expert`` there builds ``rows`` / ``block_e`` from a stable argsort and a dozen torch ops:
some fifteen launches and a multi-pass radix sort per MoE layer, each step paying their host
time. Here one program counts the pairs per expert (``tl.histogram``), scans the block counts,
writes each expert's blocks and drops every pair into its expert's next free row by an atomic
counter; two fills before it mark every row padding and every block unused.

The rows of one expert's blocks come in the order the atomics grant them, not in pair order. The
grouped kernels compute each row apart (a row's dot products read only that row), so any order
gives the same outputs bit for bit; the blocks hold the same pairs as the argsort's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sort_by_expert_triton"]

_CHUNK = 1024


@triton.jit
def _sort_kernel(
    p_ids, p_rows, p_block_e, p_next, num_pairs,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < E
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        o_p = p0 + tl.arange(0, CHUNK)
        m_p = o_p < num_pairs
        b_ids = tl.load(p_ids + o_p, mask=m_p, other=0).to(tl.int32)
        counts += tl.histogram(b_ids, E_PAD, mask=m_p)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_start = tl.cumsum(blocks, 0) - blocks
    tl.store(p_next + o_e, block_start * BLOCK_M, mask=m_e)
    for j in range(0, tl.max(blocks, 0)):
        tl.store(p_block_e + block_start + j, o_e.to(tl.int64), mask=m_e & (j < blocks))
    # The row counters above, and the fills before the launch, before any pair is placed.
    tl.debug_barrier()
    for p0 in range(0, num_pairs, CHUNK):
        o_p = p0 + tl.arange(0, CHUNK)
        m_p = o_p < num_pairs
        b_ids = tl.load(p_ids + o_p, mask=m_p, other=0)
        dest = tl.atomic_add(p_next + b_ids, 1, mask=m_p)
        tl.store(p_rows + dest, o_p.to(tl.int64), mask=m_p)


def sort_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, block_e)`` of ``kernels.moe.triton_grouped`` for ``topk_ids`` ``[T, k]`` (ids below
    ``num_experts``): the same blocks as ``sort_by_expert``'s, each block's rows in any order."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=flat.device)
    block_e = torch.full((num_blocks,), num_experts, dtype=torch.int64, device=flat.device)
    next_row = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    _sort_kernel[(1,)](
        flat, rows, block_e, next_row, num_pairs,
        E=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=_CHUNK, num_warps=8,
    )  # fmt: skip
    return rows, block_e
