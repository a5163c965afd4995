"""The experts of one token (batch-1 decode): two weight-streaming kernels.

Same semantics as ``kernels.moe.fused_moe`` for ``T == 1`` (``kernels.triton.fused_moe`` sends one
token here), and ``fused_moe_token_routed`` as ``kernels.moe.fused_moe_routed`` (the routing inside
the gate/up kernel). With one token the experts' bytes are small (9 × 3 × 2048 × 512 bf16 = 57 MB
a layer at the 35B-A3B shape, ~14 µs at 4 TB/s), so what costs is the time the weight stream stands
still: a kernel's first loads waiting for its inputs, the last wave's stragglers. The two stages
are written like ``kernels.triton.gemv``'s GEMVs (a fixed grid of programs walking tiles, the next
tile in flight while one is reduced):

    gate/up  act[s, n] = silu(x · Wg[e_s][n]) * (x · Wu[e_s][n])      slot-major: ``NUM_P``
             programs per slot walk its blocks of ``BLOCK_N`` gate and up rows. Routed, each
             program finds its slot's expert alone (``moe_route.select_expert``: ``s + 1`` arg-max
             rounds over the logits, once per program) and program 0 writes the weights and ids.
    down     out[m] = Σ_s w_s * (act[s] · Wd[e_s][m])                  programs walk blocks of
             ``BLOCK_N`` output rows; a block's rows of all ``S`` experts are one load (every byte
             of the block in flight at once), the next block's with ``PREFETCH``; fp32 sums, one
             rounding at the end, fixed order (deterministic).

Under programmatic dependent launch (``kernels/triton/_pdl.py``) a kernel may load, before its
``gdc_wait``, only what no kernel before it in the step writes: the weights, not the ids. Both
stages load the last slot's tile of the **last expert** before the wait — in the model's layout
(``kernels.moe.moe_route_shared``) the last slot is the shared expert, stored last — and after the
wait check the ids: where the last slot holds another expert, that tile is loaded again (correct
for any ids, only slower). So the stream starts while the router (gate/up) or gate/up (down)
finish.

``act`` rounds to ``x.dtype`` between the stages, as the reference's intermediate does.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.triton._pdl import LAUNCH_PDL, PDL
from phloem.kernels.triton.moe_route import MAX_EXPERTS, route_row, select_expert

__all__ = ["DEFAULT_CONFIG", "MoeTokenConfig", "covered", "fused_moe_token", "fused_moe_token_routed", "launch_down", "launch_gate_up"]


class MoeTokenConfig(NamedTuple):
    """Rows per tile, warps and programs per SM of gate/up (``1``) and of down (``2``; 0 programs per
    SM: one program per tile), and whether down's programs load their next block's tiles ahead."""

    block_n1: int
    num_warps1: int
    programs_per_sm1: int
    block_n2: int
    num_warps2: int
    programs_per_sm2: int
    prefetch2: bool


_ENV_VAR = "PHLOEM_MOE_TOKEN_CONFIG"
# Chosen on an H200 at the 35B-A3B shape (docs/bench/moe_token_sweep.py; docs/benchmarks.md).
_H200_CONFIG = MoeTokenConfig(block_n1=4, num_warps1=4, programs_per_sm1=4, block_n2=2, num_warps2=4,
                              programs_per_sm2=2, prefetch2=True)  # fmt: skip
MAX_SLOTS = 64


def _env_config() -> MoeTokenConfig | None:
    """``PHLOEM_MOE_TOKEN_CONFIG="bn1,w1,pps1,bn2,w2,pps2,prefetch2"`` (sweeps, other GPUs), else None."""
    text = os.environ.get(_ENV_VAR, "").strip()
    if not text:
        return None
    try:
        *ints, prefetch = (int(v) for v in text.split(","))
        return MoeTokenConfig(*ints, bool(prefetch))
    except (TypeError, ValueError):
        raise ValueError(f"{_ENV_VAR}: expected 7 comma-separated integers, got {text!r}") from None


DEFAULT_CONFIG = _env_config() or _H200_CONFIG


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
    p_x, p_w, p_ids, p_act, p_logits, p_tw, E_LAST, NUM_P,
    S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUTE: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    # Slot-major: NUM_P programs per slot, each walking the slot's blocks p, p + NUM_P, ...
    i_p = tl.program_id(0)
    s = i_p // NUM_P
    p = i_p % NUM_P
    NB: tl.constexpr = (INTER + BLOCK_N - 1) // BLOCK_N
    o_b = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, KP)
    m_k = o_k < H
    last = s == S - 1
    b_g, b_u = _gate_up_tile(p_w, E_LAST, p, o_b, o_k, m_k, H, INTER, BLOCK_N, last)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the router's logits or ids, and the normed row (kernels/triton/_pdl.py)
    b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    if ROUTE:
        # Slots: the routed top-(S - 1) of the E_LAST experts' logits, then the shared expert E_LAST
        # (moe_route_shared's layout); one program writes the weights and ids the down stage reads.
        e = E_LAST.to(tl.int64)
        if s != S - 1:
            e = select_expert(p_logits, s, E_LAST, BE).to(tl.int64)
        if i_p == 0:
            route_row(p_logits, p_tw, p_ids, E_LAST, S - 1, BE, BR, RENORMALIZE, True)
    else:
        e = tl.load(p_ids + s)
    if (s != S - 1) | (e != E_LAST):  # not the tile loaded before the wait
        b_g, b_u = _gate_up_tile(p_w, e, p, o_b, o_k, m_k, H, INTER, BLOCK_N, True)
    for i_blk in range(p, NB, NUM_P):
        b_gc, b_uc = b_g, b_u
        b_g, b_u = _gate_up_tile(p_w, e, i_blk + NUM_P, o_b, o_k, m_k, H, INTER, BLOCK_N, i_blk + NUM_P < NB)
        b_gate = tl.sum(b_gc.to(tl.float32) * b_x[None, :], axis=1)
        b_up = tl.sum(b_uc.to(tl.float32) * b_x[None, :], axis=1)
        b_act = b_gate * tl.sigmoid(b_gate) * b_up
        o_n = i_blk * BLOCK_N + o_b
        tl.store(p_act + s * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=o_n < INTER)


@triton.jit
def _down_tiles(p_w, b_er, m_r, e_last, i_blk, o_b, o_i, H: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, ok):
    """Rows of block ``i_blk`` of the routed slots' experts ``b_er`` ``[SR, BLOCK_N, IP]`` and of the
    last slot's expert ``e_last`` ``[BLOCK_N, IP]`` (zeros where not ``ok``)."""
    o_n = i_blk * BLOCK_N + o_b
    m_2 = ((o_n < H) & ok)[:, None] & (o_i < INTER)[None, :]
    o_2 = o_n[:, None].to(tl.int64) * INTER + o_i[None, :]
    b_last = tl.load(p_w + e_last.to(tl.int64) * (H * INTER) + o_2, mask=m_2, other=0.0)
    p_r = p_w + b_er.to(tl.int64)[:, None, None] * (H * INTER) + o_2[None, :, :]
    b_r = tl.load(p_r, mask=m_r[:, None, None] & m_2[None, :, :], other=0.0)
    return b_r, b_last


@triton.jit(do_not_specialize=["E_LAST"])
def _down_token_kernel(
    p_act, p_w, p_ids, p_tw, p_out, E_LAST,
    S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    SR: tl.constexpr, IP: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    # A block's rows of every slot's expert in one load ([SR, BLOCK_N, IP] routed + the last slot's
    # [BLOCK_N, IP]): all of a block's bytes in flight at once. Programs walk blocks i_p, i_p + n_p, ...
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    NB: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    o_b = tl.arange(0, BLOCK_N)
    o_i = tl.arange(0, IP)
    m_i = o_i < INTER
    o_r = tl.arange(0, SR)
    m_r = o_r < S - 1
    o_n = i_p * BLOCK_N + o_b
    m_2 = (o_n < H)[:, None] & m_i[None, :]
    b_last = tl.load(p_w + E_LAST.to(tl.int64) * (H * INTER) + o_n[:, None].to(tl.int64) * INTER + o_i[None, :],
                     mask=m_2, other=0.0)  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # gate/up's act (and the ids before it)
    b_er = tl.load(p_ids + o_r, mask=m_r, other=0)
    e_last = tl.load(p_ids + S - 1)
    b_ar = tl.load(p_act + o_r[:, None] * INTER + o_i[None, :], mask=m_r[:, None] & m_i[None, :], other=0.0).to(tl.float32)
    b_ar = b_ar * tl.load(p_tw + o_r, mask=m_r, other=0.0).to(tl.float32)[:, None]  # [SR, IP]
    b_alast = tl.load(p_act + (S - 1) * INTER + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_alast = b_alast * tl.load(p_tw + S - 1).to(tl.float32)  # [IP]
    b_r, b_l2 = _down_tiles(p_w, b_er, m_r, e_last, i_p, o_b, o_i, H, INTER, BLOCK_N, True)
    if e_last != E_LAST:
        b_last = b_l2
    for i_blk in range(i_p, NB, n_p):
        if PREFETCH:
            b_rc, b_lc = b_r, b_last
            b_r, b_last = _down_tiles(p_w, b_er, m_r, e_last, i_blk + n_p, o_b, o_i, H, INTER, BLOCK_N, i_blk + n_p < NB)
        else:
            if i_blk != i_p:
                b_r, b_last = _down_tiles(p_w, b_er, m_r, e_last, i_blk, o_b, o_i, H, INTER, BLOCK_N, True)
            b_rc, b_lc = b_r, b_last
        b_acc = tl.sum(b_rc.to(tl.float32) * b_ar[:, None, :], axis=0) + b_lc.to(tl.float32) * b_alast[None, :]
        o_n = i_blk * BLOCK_N + o_b
        tl.store(p_out + o_n, tl.sum(b_acc, axis=1).to(p_out.dtype.element_ty), mask=o_n < H)


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
    config: MoeTokenConfig | None = None,
) -> torch.Tensor:
    """``kernels.moe.fused_moe`` for one token (callers check ``covered``)."""
    c = config or DEFAULT_CONFIG
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    act, out = _buffers(x, w_gate_up, w_down, ids.shape[1])
    launch_gate_up(x.contiguous(), w_gate_up, ids, act, c)
    launch_down(act, w_down, ids, tw, out, c)
    return out


def fused_moe_token_routed(
    x: torch.Tensor,  # [1, H]
    router_logits: torch.Tensor,  # [1, E + 1]: the routed experts' logits, then the shared gate's
    w_gate_up: torch.Tensor,  # [E + 1, 2I, H]
    w_down: torch.Tensor,  # [E + 1, H, I]
    top_k: int,
    renormalize: bool,
    config: MoeTokenConfig | None = None,
) -> torch.Tensor:
    """``kernels.moe.fused_moe_routed`` for one token: each gate/up program finds its slot's expert
    (``moe_route.select_expert``) and one writes the weights and ids the down stage reads."""
    c = config or DEFAULT_CONFIG
    slots = top_k + 1
    ids = torch.empty((1, slots), dtype=torch.int64, device=x.device)
    tw = torch.empty((1, slots), dtype=router_logits.dtype, device=x.device)
    act, out = _buffers(x, w_gate_up, w_down, slots)
    launch_gate_up(x.contiguous(), w_gate_up, ids, act, c, (router_logits, tw, renormalize))
    launch_down(act, w_down, ids, tw, out, c)
    return out


def _buffers(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    inter = w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, x.shape[1]) and w_down.shape[1:] == (x.shape[1], inter), "expert shapes"
    return torch.empty((slots, inter), dtype=x.dtype, device=x.device), torch.empty_like(x)


def _grid(tiles: int, programs_per_sm: int, device: torch.device, share: int = 1) -> int:
    """Programs walking equal numbers of ``tiles`` (the last wave's stragglers set a kernel's time),
    at most ``programs_per_sm`` an SM among ``share`` such grids (0: one program per tile)."""
    if programs_per_sm == 0:
        return tiles
    cap = max(1, programs_per_sm * _num_sms(device) // share)
    return triton.cdiv(tiles, triton.cdiv(tiles, cap))


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor, ids: torch.Tensor, act: torch.Tensor, c: MoeTokenConfig,
                   route: tuple[torch.Tensor, torch.Tensor, bool] | None = None) -> None:  # fmt: skip
    """Stage 1 into ``act`` ``[S, I]`` (sweeps time the stages one by one). With ``route`` (router
    logits ``[1, E + 1]``, weights out ``[1, S]``, renormalise) the kernel routes and writes ``ids``
    and the weights itself."""
    num_slots, inter = act.shape
    hidden = x.shape[1]
    blocks = triton.cdiv(inter, c.block_n1)
    per_slot = _grid(blocks, c.programs_per_sm1, x.device, share=num_slots)
    logits, tw, renormalize = route if route is not None else (x, x, False)
    experts = w_gate_up.shape[0] - 1
    if route is not None and (logits.shape[1] != experts + 1 or logits.stride(-1) != 1
                              or not 2 <= num_slots <= experts + 1 or experts > MAX_EXPERTS):  # fmt: skip
        raise ValueError(f"need unit-stride logits [1, E + 1] for E + 1 = {experts + 1} experts, 1 <= top_k <= E <= {MAX_EXPERTS}, "
                         f"got logits {tuple(logits.shape)} strides {logits.stride()}, {num_slots - 1} routed slots")  # fmt: skip
    _gate_up_token_kernel[(num_slots * per_slot,)](
        x, w_gate_up, ids, act, logits, tw, w_gate_up.shape[0] - 1, per_slot,
        S=num_slots, H=hidden, INTER=inter, KP=triton.next_power_of_2(hidden), BLOCK_N=c.block_n1,
        ROUTE=route is not None, BE=triton.next_power_of_2(w_gate_up.shape[0] - 1) if route is not None else 1,
        BR=triton.next_power_of_2(max(num_slots - 1, 1)), RENORMALIZE=renormalize,
        num_warps=c.num_warps1, launch_pdl=LAUNCH_PDL,
    )  # fmt: skip


def launch_down(act: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor, tw: torch.Tensor, out: torch.Tensor,
                c: MoeTokenConfig) -> None:  # fmt: skip
    """Stage 2 into ``out`` ``[1, H]``."""
    num_slots, inter = act.shape
    hidden = out.shape[1]
    grid = _grid(triton.cdiv(hidden, c.block_n2), c.programs_per_sm2, out.device)
    _down_token_kernel[(grid,)](
        act, w_down, ids, tw, out, w_down.shape[0] - 1,
        S=num_slots, H=hidden, INTER=inter, SR=triton.next_power_of_2(max(num_slots - 1, 1)),
        IP=triton.next_power_of_2(inter), BLOCK_N=c.block_n2, PREFETCH=c.prefetch2,
        num_warps=c.num_warps2, launch_pdl=LAUNCH_PDL,
    )  # fmt: skip
