"""The experts of one token (batch-1 decode): two weight-streaming kernels, routed ids given.

Same semantics as ``kernels.moe.fused_moe`` for ``T == 1`` (``kernels.triton.fused_moe`` sends one
token here). With one token the experts' bytes are small (9 × 3 × 2048 × 512 bf16 = 57 MB a
layer at the 35B-A3B shape, ~14 µs at 4 TB/s), so what costs is the time the weight stream
stands still: a kernel's first loads waiting for its inputs, the last wave's stragglers. The two
stages are written like ``kernels.triton.gemv``'s GEMVs, whose weight stream runs at 3.9-4.4 TB/s:

    gate/up  act[s, n] = silu(x · Wg[e_s][n]) * (x · Wu[e_s][n])      tiles of BLOCK_N rows of
             a slot's gate and up weights; a fixed grid of programs (``programs_per_sm``) walks the
             ``S × cdiv(I, BLOCK_N)`` tiles, the next tile in flight while one is reduced.
    down     out[m] = Σ_s w_s * (act[s] · Wd[e_s][m])                  a program per BLOCK_N
             output rows walks the ``S`` slots, the next slot's tile (and its ``act`` row) in flight;
             fp32 sums, one rounding at the end, fixed order (deterministic).

Under programmatic dependent launch (``kernels/triton/_pdl.py``) a kernel may load, before its
``gdc_wait``, only what no kernel of the step writes: the weights, not the ids. Both stages visit
the last slot first and load its tile of the **last expert** before the wait — in the model's
layout (``kernels.moe.moe_route_shared``) the last slot is the shared expert, stored last — and
after the wait check the ids: where the last slot holds another expert, that tile is loaded again
(correct for any ids, only slower). So the stream starts while the router (gate/up) or gate/up
(down) finish.

``act`` rounds to ``x.dtype`` between the stages, as the reference's intermediate does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.triton._pdl import LAUNCH_PDL, PDL

__all__ = ["MoeTokenConfig", "covered", "fused_moe_token", "launch_down", "launch_gate_up"]


class MoeTokenConfig(NamedTuple):
    """Rows per tile, warps and programs per SM of gate/up (``1``; 0 programs per SM: one program
    per tile), rows per program and warps of down (``2``)."""

    block_n1: int
    num_warps1: int
    programs_per_sm1: int
    block_n2: int
    num_warps2: int


# Chosen on an H200 at the 35B-A3B shape (docs/bench/moe_sweep.py --token; docs/benchmarks.md).
DEFAULT_CONFIG = MoeTokenConfig(block_n1=2, num_warps1=8, programs_per_sm1=4, block_n2=4, num_warps2=4)
MAX_SLOTS = 64


@triton.jit
def _slot_value(b_vals, o_s, v):
    """``b_vals[v]`` of a small register vector, as a scalar."""
    return tl.sum(tl.where(o_s == v, b_vals, 0))


@triton.jit
def _gate_up_tile(p_w, e, i_blk, o_b, o_k, m_k, H: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, ok):
    """Expert ``e``'s gate and up rows of block ``i_blk``: two ``[BLOCK_N, KP]`` tiles (zeros if not ``ok``)."""
    o_n = i_blk * BLOCK_N + o_b
    m_w = ((o_n < INTER) & ok)[:, None] & m_k[None, :]
    p_g = p_w + e.to(tl.int64) * (2 * INTER * H) + o_n[:, None].to(tl.int64) * H + o_k[None, :]
    b_g = tl.load(p_g, mask=m_w, other=0.0)
    b_u = tl.load(p_g + INTER * H, mask=m_w, other=0.0)
    return b_g, b_u


@triton.jit(do_not_specialize=["E_LAST"])
def _gate_up_token_kernel(
    p_x, p_w, p_ids, p_act, E_LAST,
    S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BS: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    NB: tl.constexpr = (INTER + BLOCK_N - 1) // BLOCK_N
    o_b = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, KP)
    m_k = o_k < H
    o_s = tl.arange(0, BS)
    # Tile t is block t % NB of slot (t // NB + S - 1) % S: the last slot's tiles come first.
    b_g, b_u = _gate_up_tile(p_w, E_LAST, i_p % NB, o_b, o_k, m_k, H, INTER, BLOCK_N, i_p < NB)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the router's ids and normed row (kernels/triton/_pdl.py)
    b_ids = tl.load(p_ids + o_s, mask=o_s < S, other=0)
    b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    s_0 = (i_p // NB + S - 1) % S
    e_0 = _slot_value(b_ids, o_s, s_0)
    if (i_p >= NB) | (e_0 != E_LAST):  # not the prefetched (last-expert) tile after all
        b_g, b_u = _gate_up_tile(p_w, e_0, i_p % NB, o_b, o_k, m_k, H, INTER, BLOCK_N, i_p < S * NB)
    for t in range(i_p, S * NB, n_p):
        t_next = t + n_p
        e_next = _slot_value(b_ids, o_s, (t_next // NB + S - 1) % S)
        b_gc, b_uc = b_g, b_u
        b_g, b_u = _gate_up_tile(p_w, e_next, t_next % NB, o_b, o_k, m_k, H, INTER, BLOCK_N, t_next < S * NB)
        b_gate = tl.sum(b_gc.to(tl.float32) * b_x[None, :], axis=1)
        b_up = tl.sum(b_uc.to(tl.float32) * b_x[None, :], axis=1)
        b_act = b_gate * tl.sigmoid(b_gate) * b_up
        o_n = (t % NB) * BLOCK_N + o_b
        s = (t // NB + S - 1) % S
        tl.store(p_act + s * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=o_n < INTER)


@triton.jit
def _down_tile(p_w, e, o_n, m_n, o_i, INTER: tl.constexpr, H: tl.constexpr, ok):
    """Expert ``e``'s down rows ``o_n``: ``[BLOCK_N, IP]`` (zeros if not ``ok``)."""
    m_i = (o_i < INTER) & ok
    p_d = p_w + e.to(tl.int64) * (H * INTER) + o_n[:, None].to(tl.int64) * INTER + o_i[None, :]
    return tl.load(p_d, mask=m_n[:, None] & m_i[None, :], other=0.0)


@triton.jit(do_not_specialize=["E_LAST"])
def _down_token_kernel(
    p_act, p_w, p_ids, p_tw, p_out, E_LAST,
    S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    BS: tl.constexpr, IP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    o_n = i_p * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    o_i = tl.arange(0, IP)
    o_s = tl.arange(0, BS)
    # Slots in the order S-1, 0, 1, ..., S-2: the last slot's tile goes out before the wait.
    b_w = _down_tile(p_w, E_LAST, o_n, m_n, o_i, INTER, H, True)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # gate/up's act (and the router's ids before it)
    b_ids = tl.load(p_ids + o_s, mask=o_s < S, other=0)
    b_tw = tl.load(p_tw + o_s, mask=o_s < S, other=0.0).to(tl.float32)
    e_0 = _slot_value(b_ids, o_s, S - 1)
    if e_0 != E_LAST:
        b_w = _down_tile(p_w, e_0, o_n, m_n, o_i, INTER, H, True)
    m_i = o_i < INTER
    b_a = tl.load(p_act + (S - 1) * INTER + o_i, mask=m_i, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, IP], dtype=tl.float32)
    for j in range(0, S):
        s = (j + S - 1) % S
        s_next = j % S  # the slot after s in the walk
        ok_next = j + 1 < S
        b_wc = b_w
        b_ac = b_a * _slot_value(b_tw, o_s, s)
        b_w = _down_tile(p_w, _slot_value(b_ids, o_s, s_next), o_n, m_n, o_i, INTER, H, ok_next)
        b_a = tl.load(p_act + s_next * INTER + o_i, mask=m_i & ok_next, other=0.0).to(tl.float32)
        acc += b_wc.to(tl.float32) * b_ac[None, :]
    tl.store(p_out + o_n, tl.sum(acc, axis=1).to(p_out.dtype.element_ty), mask=m_n)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a small grid, so programs walk several tiles
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def covered(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """One token with contiguous expert weights of one dtype and at most ``MAX_SLOTS`` slots."""
    return (
        x.shape[0] == 1 and topk_ids.shape[0] == 1 and topk_ids.shape[1] <= MAX_SLOTS
        and w_gate_up.is_contiguous() and w_down.is_contiguous() and x.dtype == w_gate_up.dtype == w_down.dtype
    )  # fmt: skip


def fused_moe_token(
    x: torch.Tensor,  # [1, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [1, S]
    topk_ids: torch.Tensor,  # [1, S]
    config: MoeTokenConfig = DEFAULT_CONFIG,
) -> torch.Tensor:
    """``kernels.moe.fused_moe`` for one token (callers check ``covered``)."""
    inter = w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, x.shape[1]) and w_down.shape[1:] == (x.shape[1], inter), "expert shapes"
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    act = torch.empty((ids.shape[1], inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    launch_gate_up(x.contiguous(), w_gate_up, ids, act, config)
    launch_down(act, w_down, ids, tw, out, config)
    return out


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor, act: torch.Tensor,
                   c: MoeTokenConfig) -> None:  # fmt: skip
    """Stage 1 into ``act`` ``[S, I]`` (sweeps time the stages one by one)."""
    num_slots, inter = act.shape
    hidden = x.shape[1]
    tiles = num_slots * triton.cdiv(inter, c.block_n1)
    # Programs walk equal numbers of tiles (the last wave's stragglers set the kernel's time).
    cap = c.programs_per_sm1 * _num_sms(x.device)
    grid = tiles if c.programs_per_sm1 == 0 else triton.cdiv(tiles, triton.cdiv(tiles, cap))
    _gate_up_token_kernel[(grid,)](
        x, w_gate_up, ids, act, w_gate_up.shape[0] - 1,
        S=num_slots, H=hidden, INTER=inter, BS=triton.next_power_of_2(num_slots), KP=triton.next_power_of_2(hidden),
        BLOCK_N=c.block_n1, num_warps=c.num_warps1, launch_pdl=LAUNCH_PDL,
    )  # fmt: skip


def launch_down(act: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, out: torch.Tensor,
                c: MoeTokenConfig) -> None:  # fmt: skip
    """Stage 2 into ``out`` ``[1, H]``."""
    num_slots, inter = act.shape
    hidden = out.shape[1]
    _down_token_kernel[(triton.cdiv(hidden, c.block_n2),)](
        act, w_down, ids, tw, out, w_down.shape[0] - 1,
        S=num_slots, H=hidden, INTER=inter, BS=triton.next_power_of_2(num_slots), IP=triton.next_power_of_2(inter),
        BLOCK_N=c.block_n2, num_warps=c.num_warps2, launch_pdl=LAUNCH_PDL,
    )  # fmt: skip
