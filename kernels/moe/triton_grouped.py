"""Fused MoE experts for prefill-sized batches: a grouped GEMM over tokens sorted by expert.

Same signature and semantics as ``kernels.moe.reference.fused_moe``. The reference runs one pair of GEMMs
per expert the batch reaches, with a host sync per expert; the decode kernel
(``triton.fused_moe``) re-reads an expert's weights once per token. Here the ``T × k``
(token, slot) pairs are sorted by expert and cut into blocks of ``BLOCK_M`` pairs of one expert
(the last block of each expert padded), so every weight tile is read once per block and fed to
tensor cores:

    rows      [num_blocks * BLOCK_M]  pair index t * k + j, or -1 for padding
    block_e   [num_blocks]            the expert of each block (E for unused blocks)

    stage 1   act[p]   = silu(x[t] @ Wg[e]ᵀ) * (x[t] @ Wu[e]ᵀ)     one program per (block, N tile)
    stage 2   part[p]  = topk_weights[p] * (act[p] @ Wd[e]ᵀ)
    out[t]    = Σ_j part[t, j]                                   (fp32, one torch sum)

The block layout is built on the device without a host sync: ``num_blocks`` is the upper bound
``cdiv(T·k, BLOCK_M) + E`` and programs of unused blocks return at once. ``sort_by_expert`` builds
it in torch (the reference of the layout); ``fused_moe_grouped`` builds it in one Triton launch
(``kernels.moe.triton_sort``).

Block-FP8 experts (``kernels.moe.triton_fp8``): each ``[BLOCK_K, BLOCK_N]`` weight tile is loaded as
e4m3 with one scale per row (``BLOCK_K`` divides 128) and dequantized to ``x.dtype`` before its
``tl.dot``: weight-only dequantization, the bf16 tensor-core GEMM otherwise unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe.triton_fp8 import expert_operand
from phloem.kernels.moe.triton_sort import sort_by_expert_triton

__all__ = ["fused_moe_grouped", "sort_by_expert"]


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, block_e)`` of the module docstring for ``topk_ids`` ``[T, k]``."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + num_experts
    order = torch.argsort(flat, stable=True)
    # Not ``torch.bincount``: on CUDA it reads the largest id on the host (a device sync per MoE layer).
    counts = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - pair_start[sorted_e]
    dest = (block_end - blocks)[sorted_e] * block_m + rank
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int64, device=flat.device)
    rows[dest] = order
    block_e = torch.searchsorted(block_end, torch.arange(num_blocks, device=flat.device), right=True)
    return rows, block_e


@triton.jit
def block_tile(p_rows, p_block_e, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program's tile of the module docstring's layout, program ids ``(block, N tile)``: its
    block's expert ``e`` (``>= E`` for an unused block: the caller returns), the block's pair indices
    ``b_pair`` ``[BLOCK_M]`` (0 for padding) with their mask ``m_m``, and the columns ``o_n``
    ``[BLOCK_N]`` with their mask ``m_n`` against ``N``. Shared with ``kernels.moe.triton_grouped_w8a8``."""
    i_b = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    e = tl.load(p_block_e + i_b).to(tl.int64)
    b_rows = tl.load(p_rows + i_b * BLOCK_M + tl.arange(0, BLOCK_M))
    m_m = b_rows >= 0
    b_pair = tl.where(m_m, b_rows, 0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    return e, b_pair, m_m, o_n, m_n


@triton.jit
def _grouped_gate_up_kernel(
    p_x, p_w, p_s, p_rows, p_block_e, p_act,
    E: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    e, b_pair, m_m, o_n, m_n = block_tile(p_rows, p_block_e, INTER, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    b_tok = b_pair // TOP_K
    p_we = p_w + e * (2 * INTER * H)
    KB: tl.constexpr = (H + 127) // 128
    p_se = p_s + e * (2 * INTER * KB)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + b_tok[:, None] * H + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the row-major [2I, H] expert weight, read transposed.
        b_wg = tl.load(p_we + o_n[None, :] * H + o_k[:, None], mask=m_w, other=0.0)
        b_wu = tl.load(p_we + (o_n[None, :] + INTER) * H + o_k[:, None], mask=m_w, other=0.0)
        if FP8:
            # The tile lies in one 128-column block (BLOCK_K divides 128): one scale per row.
            b_sg = tl.load(p_se + o_n * KB + k0 // 128, mask=m_n, other=0.0)
            b_su = tl.load(p_se + (o_n + INTER) * KB + k0 // 128, mask=m_n, other=0.0)
            b_wg = (b_wg.to(tl.float32) * b_sg[None, :]).to(b_x.dtype)
            b_wu = (b_wu.to(tl.float32) * b_su[None, :]).to(b_x.dtype)
        acc_g = tl.dot(b_x, b_wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(b_x, b_wu, acc_u, input_precision=PRECISION)
    b_act = acc_g * tl.sigmoid(acc_g) * acc_u
    p_out = p_act + b_pair[:, None] * INTER + o_n[None, :]
    tl.store(p_out, b_act.to(p_act.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _grouped_down_kernel(
    p_act, p_w, p_s, p_rows, p_block_e, p_tw, p_part,
    E: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    e, b_pair, m_m, o_n, m_n = block_tile(p_rows, p_block_e, H, BLOCK_M, BLOCK_N)
    if e >= E:
        return
    p_we = p_w + e * (H * INTER)
    KB: tl.constexpr = (INTER + 127) // 128
    p_se = p_s + e * (H * KB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < INTER
        b_a = tl.load(p_act + b_pair[:, None] * INTER + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_we + o_n[None, :] * INTER + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if FP8:
            b_s = tl.load(p_se + o_n * KB + k0 // 128, mask=m_n, other=0.0)
            b_w = (b_w.to(tl.float32) * b_s[None, :]).to(b_a.dtype)
        acc = tl.dot(b_a, b_w, acc, input_precision=PRECISION)
    b_tw = tl.load(p_tw + b_pair, mask=m_m, other=0.0).to(tl.float32)
    p_out = p_part + b_pair[:, None] * H + o_n[None, :]
    tl.store(p_out, acc * b_tw[:, None], mask=m_m[:, None] & m_n[None, :])


def fused_moe_grouped(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor | Fp8Weight,  # [E, 2I, H]
    w_down: torch.Tensor | Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``kernels.moe.reference.fused_moe`` as a grouped GEMM (tile sizes exposed for sweeps). Block-FP8
    experts (``kernels.moe.triton_fp8``) are dequantized tile by tile to ``x.dtype`` before each
    ``tl.dot``, so ``block_k`` must divide 128 for them."""
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w_down.shape[0], topk_ids.shape[1], w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, hidden) and w_down.shape[1:] == (hidden, inter), "expert shapes"
    x, tw = x.contiguous(), topk_weights.contiguous()
    w13, s13, fp8_13 = expert_operand(w_gate_up)
    w2, s2, fp8_2 = expert_operand(w_down)
    if (fp8_13 or fp8_2) and 128 % block_k:
        raise ValueError(f"block_k: expected a divisor of 128 for block-FP8 experts, got {block_k}")
    rows, block_e = sort_by_expert_triton(topk_ids, num_experts, block_m)
    num_blocks = block_e.numel()
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    # fp32 models (tests) keep full precision; TF32 would drift from the reference.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    kw = dict(E=num_experts, H=hidden, INTER=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
              PRECISION=precision, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    _grouped_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, s13, rows, block_e, act, TOP_K=top_k, FP8=fp8_13, **kw
    )
    _grouped_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](act, w2, s2, rows, block_e, tw, part, FP8=fp8_2, **kw)
    return part.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
