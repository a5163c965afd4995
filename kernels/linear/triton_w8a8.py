"""W8A8 block-FP8 linear on tensor cores: Triton versions of ``kernels.linear.w8a8``.

Two launches: ``fp8_act_quant`` (per token and 128-column group, the references' rule) and
``w8a8_block_matmul``, a GEMM over e4m3 operands (``tl.dot`` on ``float8e4nv``: wgmma on sm_90)
with fp32 accumulators. Each ``BLOCK_K = 128`` step is one scale block of both operands, so the
step's dot is scaled by ``x_scale[m, kb]`` ``[BLOCK_M]`` times ``scale_inv[n, kb]`` ``[BLOCK_N]`` (one
weight scale per row and block, ``Fp8Weight``'s layout) before it is added to the accumulator::

    acc[m, n] = sum_kb  x_scale[m, kb] * scale_inv[n, kb] * sum_{k in kb} x_fp8[m, k] * w_fp8[n, k]

Each step's dot is a fresh one, added into the fp32 accumulator outside it: on sm_90 Triton lets
the FP8 wgmma accumulate in its own reduced precision (``max_num_imprecise_acc``), so this bounds
that to one 128-wide block, DeepSeek-V3's promotion interval. The weight ``[N, K]`` is read as
``[BLOCK_K, BLOCK_N]`` tiles with K contiguous (the K-major B operand FP8 wgmma needs). Edges:
rows, columns and the last K block are masked (zeros add nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.kernels.linear.fp8 import FP8_E4M3_MAX, Fp8Weight
from phloem.kernels.linear.w8a8 import FP8_GROUP

__all__ = ["fp8_act_quant", "fp8_w8a8_linear", "w8a8_block_matmul"]

# Groups one quantization program covers: [BLOCK_G, 128] tiles of one token's row.
_BLOCK_G = 8


@triton.jit
def fp8_act_quant_kernel(p_x, p_q, p_s, K, num_groups, stride_x, stride_q, stride_s,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, FP8_MAX: tl.constexpr):  # fmt: skip
    i_m = tl.program_id(0).to(tl.int64)
    i_g = tl.program_id(1).to(tl.int64)
    o_g = i_g * BLOCK_G + tl.arange(0, BLOCK_G)
    o_k = o_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    m_k = o_k < K
    b_x = tl.load(p_x + i_m * stride_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_amax = tl.max(tl.abs(b_x), axis=1)
    # IEEE divisions (``/`` is div.full, 2 ulp), a clamp, then one round-to-nearest-even cast: the
    # reference's steps, so the two agree bit for bit.
    b_s = tl.where(b_amax > 0, tl.div_rn(b_amax, FP8_MAX), 1.0)
    b_q = tl.clamp(tl.div_rn(b_x, b_s[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(p_q + i_m * stride_q + o_k, b_q.to(p_q.dtype.element_ty), mask=m_k)
    tl.store(p_s + i_m * stride_s + o_g, b_s, mask=o_g < num_groups)


def act_quant_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """``fp8_act_quant`` of ``x`` ``[M, K]`` into ``q`` ``[M, K]`` (``float8_e4m3fn``; an fp32 ``q``
    receives the clamped scaled values before the cast) and ``scale`` ``[M, ceil(K / 128)]`` fp32.
    All three with unit last stride."""
    m, k = x.shape
    num_groups = scale.shape[1]
    assert q.shape == x.shape and scale.shape == (m, -(-k // FP8_GROUP)), (x.shape, q.shape, scale.shape)
    assert x.stride(1) == q.stride(1) == scale.stride(1) == 1, "act quant: unit last strides"
    if m == 0:
        return
    grid = (m, triton.cdiv(num_groups, _BLOCK_G))
    fp8_act_quant_kernel[grid](x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0),
                               GROUP=FP8_GROUP, BLOCK_G=_BLOCK_G, FP8_MAX=FP8_E4M3_MAX)  # fmt: skip


def fp8_act_quant(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.linear.w8a8.fp8_act_quant``: ``x`` ``[M, K]`` -> ``(x_fp8 [M, K], x_scale [M, ceil(K / 128)])``."""
    if group != FP8_GROUP or x.ndim != 2:
        raise ValueError(f"fp8_act_quant: expected x [M, K] and group {FP8_GROUP}, got {tuple(x.shape)}, {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], -(-x.shape[1] // FP8_GROUP)), dtype=torch.float32, device=x.device)
    act_quant_into(x, q, scale)
    return q, scale


@triton.jit
def w8a8_block_dot(p_a_row, p_as_row, p_b_row, p_bs_row, m_m, m_n, K, num_kb,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The module docstring's ``acc`` ``[BLOCK_M, BLOCK_N]`` fp32 over ``num_kb`` ``BLOCK_K`` steps of
    ``K``: ``p_a_row`` ``[BLOCK_M]`` and ``p_b_row`` ``[BLOCK_N]`` point at the e4m3 rows' starts (K
    contiguous), ``p_as_row`` and ``p_bs_row`` at their scale rows (one scale per step); rows off
    ``m_m`` / ``m_n`` read zeros. Shared with ``kernels.moe.triton_grouped_w8a8``."""
    o_k = tl.arange(0, BLOCK_K)
    p_a_tile = p_a_row[:, None] + o_k[None, :]  # [BLOCK_M, BLOCK_K]
    p_b_tile = p_b_row[None, :] + o_k[:, None]  # [BLOCK_K, BLOCK_N], K contiguous
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i_k in range(0, num_kb):
        m_k = o_k < K - i_k * BLOCK_K
        b_a = tl.load(p_a_tile, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b_tile, mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_as = tl.load(p_as_row + i_k, mask=m_m, other=0.0)
        b_bs = tl.load(p_bs_row + i_k, mask=m_n, other=0.0)
        b_acc += tl.dot(b_a, b_b) * b_as[:, None] * b_bs[None, :]
        p_a_tile += BLOCK_K
        p_b_tile += BLOCK_K
    return b_acc


@triton.jit
def w8a8_block_matmul_kernel(p_a, p_as, p_b, p_bs, p_c, M, N, K,
                             stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):  # fmt: skip
    # Programs in column-major groups of GROUP_M row tiles, so consecutive programs share weight tiles in L2.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    i_m = (first_m + (pid % width) % rows).to(tl.int64)
    i_n = ((pid % width) // rows).to(tl.int64)

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m, m_n = o_m < M, o_n < N
    b_acc = w8a8_block_dot(p_a + o_m * stride_am, p_as + o_m * stride_asm, p_b + o_n * stride_bn, p_bs + o_n * stride_bsn,
                           m_m, m_n, K, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    p_c_tile = p_c + o_m[:, None] * stride_cm + o_n[None, :]
    tl.store(p_c_tile, b_acc.to(p_c.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for ``m`` tokens: 64 rows (one warpgroup's wgmma) up to 64
    tokens, 128 rows on two warpgroups above. Below 64 rows sm_90 has no FP8 wgmma and Triton
    upcasts the tiles to an f16 mma.sync, so a decode batch pads its rows instead."""
    return (64, 128, 4) if m <= 64 else (128, 128, 8)


def w8a8_block_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``out`` ``[M, N]`` = the block-scaled product of ``a`` ``[M, K]`` e4m3 with scales ``a_scale``
    ``[M, ceil(K / 128)]`` and ``b`` ``[N, K]`` e4m3 with scales ``b_scale`` ``[N, ceil(K / 128)]``
    (fp32 accumulation, one rounding to ``out.dtype``). Unit last strides throughout."""
    m, k = a.shape
    n = b.shape[0]
    kb = -(-k // FP8_GROUP)
    assert b.shape == (n, k) and a_scale.shape == (m, kb) and b_scale.shape == (n, kb) and out.shape == (m, n), (
        a.shape, a_scale.shape, b.shape, b_scale.shape, out.shape)  # fmt: skip
    assert all(t.stride(1) == 1 for t in (a, a_scale, b, b_scale, out)), "w8a8 matmul: unit last strides"
    if m == 0 or n == 0:
        return
    block_m, block_n, num_warps = _tiles(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    w8a8_block_matmul_kernel[grid](
        a, a_scale, b, b_scale, out, m, n, k,
        a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_GROUP, GROUP_M=8, num_warps=num_warps, num_stages=3,
    )  # fmt: skip


def fp8_w8a8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``kernels.linear.w8a8.fp8_w8a8_block_matmul_reference``: ``[..., K]`` -> ``[..., N]`` in ``weight.dtype``."""
    k = x.shape[-1]
    if weight.data.ndim != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8 w8a8 linear: expected a [N, {k}] weight for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    x_fp8, x_scale = fp8_act_quant(x.reshape(-1, k))
    out = torch.empty((x_fp8.shape[0], weight.shape[0]), dtype=weight.dtype, device=x.device)
    w = weight.data if weight.data.stride(1) == 1 else weight.data.contiguous()
    w8a8_block_matmul(x_fp8, x_scale, w, weight.scale_inv, out)
    return out.reshape(*x.shape[:-1], weight.shape[0])
