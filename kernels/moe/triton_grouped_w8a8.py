"""W8A8 block-FP8 expert projection for prefill-sized batches: the Triton version of
``kernels.moe.w8a8``, the grouped form of ``kernels.linear.triton_w8a8``.

The pairs are sorted by expert into blocks of ``BLOCK_M = 64`` pairs of one expert
(``kernels.moe.triton_sort``; the layout of ``kernels.moe.triton_grouped``'s docstring), so each
program multiplies one block's gathered e4m3 activation rows by a ``[BLOCK_K, BLOCK_N]`` tile of its
expert's e4m3 weight per step and scales the step's dot by the rows' and the weight rows' scales of
that 128-column block, as the dense GEMM does. 64 rows is one warpgroup's FP8 wgmma on sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.linear.triton_w8a8 import fp8_act_quant, w8a8_block_dot
from phloem.kernels.linear.w8a8 import FP8_GROUP
from phloem.kernels.moe.triton_grouped import block_tile
from phloem.kernels.moe.triton_sort import sort_by_expert_triton
from phloem.kernels.moe.w8a8 import pair_sources

__all__ = ["fp8_w8a8_grouped_linear"]

_BLOCK_M, _BLOCK_N = 64, 128


@triton.jit
def w8a8_grouped_matmul_kernel(p_a, p_as, p_w, p_ws, p_rows, p_block_e, p_c, N, K, num_kb,
                               E: tl.constexpr, A_DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    e, b_pair, m_m, o_n, m_n = block_tile(p_rows, p_block_e, N, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    # A_DIV = k: each pair reads its token's row (gate/up); 1: its own (down).
    b_src = b_pair // A_DIV
    # The expert's [N, K] weight rows, K contiguous.
    b_acc = w8a8_block_dot(p_a + b_src * K, p_as + b_src * num_kb, p_w + e * N * K + o_n * K, p_ws + (e * N + o_n) * num_kb,
                           m_m, m_n, K, num_kb, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    p_out = p_c + b_pair[:, None] * N + o_n[None, :]
    tl.store(p_out, b_acc.to(p_c.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def fp8_w8a8_grouped_linear(x: torch.Tensor, weight: Fp8Weight, topk_ids: torch.Tensor) -> torch.Tensor:
    """``kernels.moe.w8a8.fp8_w8a8_grouped_linear_reference``: ``x`` ``[T or T * k, K]`` -> ``[T * k, N]``."""
    num_experts, n, k = weight.shape
    pair_sources(x.shape[0], topk_ids)  # validates the row count
    if x.shape[1] != k:
        raise ValueError(f"grouped w8a8: expected x [*, {k}] for weights {tuple(weight.shape)}, got {tuple(x.shape)}")
    num_pairs = topk_ids.numel()
    out = torch.empty((num_pairs, n), dtype=weight.dtype, device=x.device)
    if num_pairs == 0:
        return out
    x_fp8, x_scale = fp8_act_quant(x.contiguous())
    rows, block_e = sort_by_expert_triton(topk_ids, num_experts, _BLOCK_M)
    w, w_scale = weight.data.contiguous(), weight.scale_inv.contiguous()
    grid = (block_e.numel(), triton.cdiv(n, _BLOCK_N))
    w8a8_grouped_matmul_kernel[grid](
        x_fp8, x_scale, w, w_scale, rows, block_e, out, n, k, x_scale.shape[1],
        E=num_experts, A_DIV=topk_ids.shape[1] if x.shape[0] != num_pairs else 1,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=FP8_GROUP, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
