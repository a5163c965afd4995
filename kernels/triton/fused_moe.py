"""Fused MoE experts for small batches (decode): grouped GEMV straight from the expert weights.

Same signature and semantics as ``kernels.moe.fused_moe``. The torch reference loops over the
experts a batch hits, with data-dependent shapes (not capturable in a CUDA graph) and one launch
per expert. Here two launches serve every (token, top-k slot) pair at once, each program reading
its expert's rows by index, so the bytes moved are the top-k experts' weights once:

    stage 1  act[t, j, n] = silu(x[t] · Wg[e][n]) * (x[t] · Wu[e][n])      e = topk_ids[t, j]
    stage 2  part[t, j, m] = act[t, j] · Wd[e][m]
    out[t]   = Σ_j topk_weights[t, j] * part[t, j]          (a deterministic sum, no atomics)

At the Qwen3.5-35B-A3B decode shape (H=2048, I=512, top-8) one token reads 8 × 3 × 2048 × 512
bf16 = 50 MB per layer, which is what bounds decode. Accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_moe"]


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
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    p_we = p_w + e * (2 * INTER * H)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + i_tok * H + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_w = m_n[:, None] & m_k[None, :]
        b_wg = tl.load(p_we + o_n[:, None] * H + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        b_wu = tl.load(p_we + (o_n[:, None] + INTER) * H + o_k[None, :], mask=m_w, other=0.0).to(tl.float32)
        acc_g += tl.sum(b_wg * b_x[None, :], axis=1)
        acc_u += tl.sum(b_wu * b_x[None, :], axis=1)
    b_act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(p_act + i_pair * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=m_n)


@triton.jit
def _down_kernel(
    p_act, p_w, p_ids, p_part,
    H: tl.constexpr, INTER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_pair = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    e = tl.load(p_ids + i_pair).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    p_we = p_w + e * (H * INTER)
    for k0 in range(0, INTER, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < INTER
        b_a = tl.load(p_act + i_pair * INTER + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(p_we + o_n[:, None] * INTER + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc += tl.sum(b_w.to(tl.float32) * b_a[None, :], axis=1)
    tl.store(p_part + i_pair * H + o_n, acc, mask=m_n)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    block_n: int = 16,
    block_k: int = 256,
) -> torch.Tensor:
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, hidden) and w_down.shape[1:] == (hidden, inter), "expert shapes"
    x, ids = x.contiguous(), topk_ids.contiguous()
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    part = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32, device=x.device)
    pairs = num_tokens * top_k
    _gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, w_gate_up, ids, act, H=hidden, INTER=inter, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k
    )
    _down_kernel[(pairs, triton.cdiv(hidden, block_n))](
        act, w_down, ids, part, H=hidden, INTER=inter, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(inter))
    )
    out = (part.view(num_tokens, top_k, hidden) * topk_weights.float()[:, :, None]).sum(dim=1)
    return out.to(x.dtype)
