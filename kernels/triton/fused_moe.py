"""Fused MoE experts for small batches (decode): grouped GEMV straight from the expert weights.

Same signature and semantics as ``kernels.moe.fused_moe``. The torch reference loops over the
experts a batch hits, with data-dependent shapes (not capturable in a CUDA graph) and one launch
per expert. Here two launches serve every (token, top-k slot) pair at once, each program reading
its expert's rows by index, so the bytes moved are the top-k experts' weights once:

    stage 1  act[t, j, n] = silu(x[t] · Wg[e][n]) * (x[t] · Wu[e][n])      e = topk_ids[t, j]
    stage 2  part[t, j, m] = topk_weights[t, j] * (act[t, j] · Wd[e][m])
    out[t]   = Σ_j part[t, j]                               (a deterministic sum, no atomics)

At the Qwen3.5-35B-A3B decode shape (H=2048, I=512, top-8) one token reads 8 × 3 × 2048 × 512
bf16 = 50 MB per layer, which is what bounds decode. Accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DEFAULT_CONFIG", "fused_moe", "fused_moe_tuned"]


@triton.jit
def _gate_up_kernel(
    p_x, p_w, p_ids, p_act,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_pair = tl.program_id(0).to(tl.int64)  # token * TOP_K + j
    i_n = tl.program_id(1).to(tl.int64)
    i_tok = i_pair // TOP_K
    e = tl.load(p_ids + i_pair).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < INTER
    # Elementwise accumulators, reduced once at the end: a cross-lane reduction per K step
    # would serialise the loads behind shuffles.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    p_we = p_w + e * (2 * INTER * H)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + i_tok * H + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_w = m_n[:, None] & m_k[None, :]
        b_wg = tl.load(p_we + o_n[:, None] * H + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        b_wu = tl.load(p_we + (o_n[:, None] + INTER) * H + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        acc_g += b_wg * b_x[None, :]
        acc_u += b_wu * b_x[None, :]
    b_g = tl.sum(acc_g, axis=1)
    b_u = tl.sum(acc_u, axis=1)
    b_act = b_g * tl.sigmoid(b_g) * b_u
    tl.store(p_act + i_pair * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=m_n)


@triton.jit
def _down_kernel(
    p_act, p_w, p_ids, p_tw, p_part,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_pair = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    e = tl.load(p_ids + i_pair).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    p_we = p_w + e * (H * INTER)
    for k0 in range(0, INTER, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < INTER
        b_a = tl.load(p_act + i_pair * INTER + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(p_we + o_n[:, None] * INTER + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc2 += b_w.to(tl.float32) * b_a[None, :]
    acc = tl.sum(acc2, axis=1)
    b_tw = tl.load(p_tw + i_pair).to(tl.float32)
    tl.store(p_part + i_pair * H + o_n, acc * b_tw, mask=m_n)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    return fused_moe_tuned(x, w_gate_up, w_down, topk_weights, topk_ids, *DEFAULT_CONFIG)


# (block_n gate/up, block_k gate/up, warps gate/up, block_n down, block_k down, warps down);
# chosen by a sweep on an H200 at the 35B-A3B shape, one token (docs/benchmarks.md).
DEFAULT_CONFIG = (8, 512, 2, 16, 128, 4)


def fused_moe_tuned(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    bn1: int,
    bk1: int,
    nw1: int,
    bn2: int,
    bk2: int,
    nw2: int,
) -> torch.Tensor:
    """``fused_moe`` with explicit block sizes and warp counts (for sweeps)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, hidden) and w_down.shape[1:] == (hidden, inter), "expert shapes"
    x, ids, tw = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    pairs = num_tokens * top_k
    _gate_up_kernel[(pairs, triton.cdiv(inter, bn1))](
        x, w_gate_up, ids, act, H=hidden, INTER=inter, TOP_K=top_k, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=nw1
    )
    _down_kernel[(pairs, triton.cdiv(hidden, bn2))](
        act, w_down, ids, tw, part, H=hidden, INTER=inter, BLOCK_N=bn2,
        BLOCK_K=min(bk2, triton.next_power_of_2(inter)), num_warps=nw2,
    )  # fmt: skip
    return part.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
