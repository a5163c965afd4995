"""A one-row GEMV whose weight stream runs through shared memory: ``y = W x`` as a tensor-core
``tl.dot`` of ``W``'s tiles with ``x`` padded to 16 columns (column 0 is ``x``, the rest zeros).

Why (docs/benchmarks.md, thirteenth session): the register GEMVs of ``kernels.triton.gemv`` keep a
tile or two in flight per program, and at the 35B-A3B shapes three of them fit one program an SM
(144-187 registers a thread); smaller tiles for more resident programs lost in the decode step.
Triton's software pipeliner stages only loads that feed ``tl.dot``: here every weight tile does,
so ``NUM_STAGES`` tiles of ``BLOCK_N x BLOCK_K`` are in flight per program through ``cp.async``
into shared memory, with an accumulator of ``BLOCK_N x 16`` fp32 (a few registers a thread). The
padded columns cost tensor-core work that the memory stream hides (2 * N * K * 16 FLOPs a call).

One program per ``BLOCK_N`` rows, the whole ``K`` walked in ``BLOCK_K`` steps; no prologue, no
programmatic dependent launch: a prototype to time against ``gemv.linear`` alone
(``docs/bench/gemv_dot_sweep.py``) before any fused projection is built on it. Rounding: ``y`` once
from the fp32 accumulation (its order differs from ``gemv.linear``'s).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["DotConfig", "linear_dot"]

XCOLS = 16  # tl.dot's smallest N


class DotConfig(NamedTuple):
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


@triton.jit
def gemv_dot_kernel(
    p_x, p_w, p_y, N, K, s_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, XC: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    o_n = i_p * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_c = tl.arange(0, XC)
    b_acc = tl.zeros([BLOCK_N, XC], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        # x as column 0 of a [BLOCK_K, XC] operand; the other columns are masked to zero (not read).
        b_x = tl.load(p_x + o_k[:, None] + o_c[None, :] * 0, mask=m_k[:, None] & (o_c == 0)[None, :], other=0.0)
        b_acc = tl.dot(b_w, b_x, b_acc, input_precision=PRECISION)
    b_y = tl.sum(tl.where(o_c[None, :] == 0, b_acc, 0.0), axis=1)
    tl.store(p_y + o_n, b_y.to(p_y.dtype.element_ty), mask=m_n)


def linear_dot(x: torch.Tensor, weight: torch.Tensor, c: DotConfig) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x`` ``[1, K]`` (``weight`` ``[N, K]``, unit last stride)."""
    num_n, num_k = weight.shape
    if x.numel() != num_k or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"need one row of K={num_k} in the weight's dtype and a unit-stride weight, got x {tuple(x.shape)} "
                         f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype} strides {weight.stride()}")  # fmt: skip
    x = x.contiguous()
    y = torch.empty((1, num_n), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    gemv_dot_kernel[(triton.cdiv(num_n, c.block_n),)](
        x, weight, y, num_n, num_k, weight.stride(0),
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, NUM_STAGES=c.num_stages, XC=XCOLS, PRECISION=precision,
        num_warps=c.num_warps,
    )  # fmt: skip
    return y
