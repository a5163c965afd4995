"""The gate/up stage of one token's experts (batch-1 decode), with the routing in its programs.

``kernels.moe.triton_decode`` runs one token's experts as this kernel, then its own down + weighted
sum (``_down_sum_kernel``): ``fused_moe`` with the ids given, ``fused_moe_routed`` with the router
logits. With one token the experts' bytes are small (9 × 3 × 2048 × 512 bf16 = 57 MB a layer at the
35B-A3B shape, ~14 µs at 4 TB/s), so what costs is the time the weight stream stands still::

    act[s, n] = silu(x · Wg[e_s][n]) * (x · Wu[e_s][n])

Slot-major: ``NUM_P`` programs per slot walk its blocks of ``BLOCK_N`` gate and up rows, the next
block's tiles in flight while one is reduced (as ``kernels.linear.triton_gemv``'s GEMVs). Routed, each
program finds its own slot's expert once (``triton_route.select_expert``: ``s + 1`` arg-max rounds over
the logits) and one program (the last, after its walk) writes the weights and ids the down stage
reads (``triton_decode._gate_up_kernel`` runs a program per (slot, block), each routing again).

With the router folded into the projection before it (``kernels/moe/route_partial.py``, ``partial``)
``x`` is the residual sum ``s``: every program computes ``rstd(s)`` and ``normed`` itself, the
logits from the accumulator's rows (loaded first), and routes on them (``moe_route.select_in``); the
last program writes the logits out for ``route_row``.

Under programmatic dependent launch (``kernels/common/pdl.py``) a kernel may load, before its
``gdc_wait``, only what no kernel before it in the step writes: the weights, not the ids. The last
slot's programs load their first tile of the **last expert** there — in the model's layout
(``kernels.moe.reference.moe_route_shared``) the last slot is the shared expert, stored last — and after the
wait check the ids: where the last slot holds another expert, the tile is loaded again (correct for
any ids, only slower).

Block-FP8 experts (``FP8``, ``triton_fp8``): each tile's scales ``[BLOCK_N, KP / 128]`` are
loaded with it, so the prefetch covers both, and the tile is dequantized where it is reduced.

The alternatives this replaced, and those that measured slower, are rows of ``docs/decisions.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.common.device import balanced_grid
from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe.route_partial import ROUTE_COPIES, ROUTE_SCALE
from phloem.kernels.moe.triton_fp8 import block_scales, expert_operand, tile_fp32
from phloem.kernels.moe.triton_route import MAX_EXPERTS, route_row, select_expert, select_in

__all__ = ["DEFAULT_CONFIG", "MAX_SLOTS", "PARTIAL_CONFIG", "MoeTokenConfig", "covered", "launch_gate_up"]


class MoeTokenConfig(NamedTuple):
    """Gate/up rows per tile, warps and programs per SM (0: one program per tile)."""

    block_n: int
    num_warps: int
    programs_per_sm: int


# The 35B-A3B shape's sweep winner (``benchmarks/sweeps/moe_token_sweep.py``). Benchmark tools pass
# another ``MoeTokenConfig`` to ``fused_moe.fused_moe_token*`` directly.
DEFAULT_CONFIG = MoeTokenConfig(block_n=2, num_warps=4, programs_per_sm=4)
MAX_SLOTS = 64
# With the router partial (``partial``) the norm and the accumulator's sums raise the kernel's
# registers so that only 3 programs fit an SM: a grid sized for 4 would leave a second wave.
PARTIAL_CONFIG = MoeTokenConfig(block_n=2, num_warps=4, programs_per_sm=3)


@triton.jit
def _gate_up_tile(p_w, p_s, e, i_blk, o_b, o_k, m_k, H: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
                  KP: tl.constexpr, FP8: tl.constexpr, ok):  # fmt: skip
    """Expert ``e``'s gate and up rows of block ``i_blk``: two ``[BLOCK_N, KP]`` tiles (zeros if not
    ``ok``) and, with ``FP8``, their scales (``triton_fp8.block_scales``; else the tiles again, unused)."""
    o_n = i_blk * BLOCK_N + o_b
    m_n = (o_n < INTER) & ok
    m_w = m_n[:, None] & m_k[None, :]
    p_g = p_w + e.to(tl.int64) * (2 * INTER * H) + o_n[:, None].to(tl.int64) * H + o_k[None, :]
    b_g = tl.load(p_g, mask=m_w, other=0.0)
    b_u = tl.load(p_g + INTER * H, mask=m_w, other=0.0)
    if FP8:
        KB: tl.constexpr = (H + 127) // 128
        p_se = p_s + e.to(tl.int64) * (2 * INTER * KB)
        b_sg = block_scales(p_se, o_n, m_n, 0, H, KP)
        b_su = block_scales(p_se + INTER * KB, o_n, m_n, 0, H, KP)
    else:
        b_sg, b_su = b_g, b_u
    return b_g, b_u, b_sg, b_su


@triton.jit
def _acc_sums(p_acc, o_e, E_LAST, COPIES: tl.constexpr):
    """The accumulator's rows (``E_LAST + 1`` wide) summed: ``u`` of the ``E_LAST`` routed experts in fixed
    point (int64; 0 past them)."""
    o_c = tl.arange(0, COPIES)
    return tl.sum(tl.load(p_acc + o_c[:, None] * (E_LAST + 1) + o_e[None, :], mask=(o_e < E_LAST)[None, :], other=0), axis=0)


@triton.jit
def _partial_logits(b_u, o_e, E_LAST, b_rstd, scale, dtype: tl.constexpr):
    """The routed logits ``rstd(s) · u`` (``kernels/moe/route_partial.py``) in ``dtype`` as fp32, ``-inf``
    past the ``E_LAST`` routed experts."""
    b_l = (b_u.to(tl.float32) * (1.0 / scale) * b_rstd).to(dtype).to(tl.float32)
    return tl.where(o_e < E_LAST, b_l, -float("inf"))


@triton.jit(do_not_specialize=["E_LAST"])
def _gate_up_token_kernel(
    p_x, p_w, p_s, p_ids, p_act, p_logits, p_tw, E_LAST, NUM_P, p_nw, eps, p_acc, scale,
    S: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUTE: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, RENORMALIZE: tl.constexpr,
    PARTIAL: tl.constexpr, COPIES: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
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
    b_g, b_u, b_sg, b_su = _gate_up_tile(p_w, p_s, E_LAST, p, o_b, o_k, m_k, H, INTER, BLOCK_N, KP, FP8, last)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the router's logits or ids, and the normed row (kernels/common/pdl.py)
    if PARTIAL:
        # x is the residual sum s: its norm here (kernels.norm.reference.rms_norm's formula), and the logits
        # from the partial sums the projection before added (kernels/moe/route_partial.py). The sums'
        # loads are issued first, with s's: one memory latency before the routing, not two. (The
        # norm weight is loaded here, not before the wait: held across it, its 2048 values cost 16
        # registers a thread for the whole walk.)
        dtype = p_x.dtype.element_ty
        o_e = tl.arange(0, BE)
        b_us = _acc_sums(p_acc, o_e, E_LAST, COPIES)
        b_s = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_s * b_s) / H + eps)
        b_x = (b_s * b_rstd * (1.0 + b_nw)).to(dtype).to(tl.float32)
        b_l = _partial_logits(b_us, o_e, E_LAST, b_rstd, scale, dtype)
    else:
        b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    if ROUTE:
        # Slots: the routed top-(S - 1) of the E_LAST experts' logits, then the shared expert E_LAST
        # (moe_route_shared's layout); one program writes the weights and ids the down stage reads.
        e = E_LAST.to(tl.int64)
        if s != S - 1:
            if PARTIAL:
                e = select_in(b_l, o_e, s).to(tl.int64)
            else:
                e = select_expert(p_logits, s, E_LAST, BE).to(tl.int64)
    else:
        e = tl.load(p_ids + s)
    if (s != S - 1) | (e != E_LAST):  # not the tile loaded before the wait
        b_g, b_u, b_sg, b_su = _gate_up_tile(p_w, p_s, e, p, o_b, o_k, m_k, H, INTER, BLOCK_N, KP, FP8, True)
    for i_blk in range(p, NB, NUM_P):
        b_gc, b_uc, b_sgc, b_suc = b_g, b_u, b_sg, b_su
        b_g, b_u, b_sg, b_su = _gate_up_tile(p_w, p_s, e, i_blk + NUM_P, o_b, o_k, m_k, H, INTER, BLOCK_N, KP, FP8,
                                             i_blk + NUM_P < NB)  # fmt: skip
        b_gate = tl.sum(tile_fp32(b_gc, b_sgc, FP8, BLOCK_N, KP) * b_x[None, :], axis=1)
        b_up = tl.sum(tile_fp32(b_uc, b_suc, FP8, BLOCK_N, KP) * b_x[None, :], axis=1)
        b_act = b_gate * tl.sigmoid(b_gate) * b_up
        o_n = i_blk * BLOCK_N + o_b
        tl.store(p_act + s * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=o_n < INTER)
    if ROUTE:
        # The weights and ids for the down stage (which waits for this kernel to end) from the last
        # program, after its walk: a shared-expert program, which routes nothing itself and starts
        # streaming before the wait (in program 0, before its walk, the routing delays slot 0's
        # first load).
        if i_p == S * NUM_P - 1:
            if PARTIAL:
                # The logits into p_logits first (the shared gate's from its column of the sums),
                # read back by route_row after a barrier (this program's own writes).
                tl.store(p_logits + o_e, b_l.to(dtype), mask=o_e < E_LAST)
                o_c = tl.arange(0, COPIES)
                b_ug = tl.sum(tl.load(p_acc + o_c * (E_LAST + 1) + E_LAST), axis=0)
                tl.store(p_logits + E_LAST, (b_ug.to(tl.float32) * (1.0 / scale) * b_rstd).to(dtype))
                tl.debug_barrier()
            route_row(p_logits, p_tw, p_ids, E_LAST, S - 1, BE, BR, RENORMALIZE, True)


def covered(x: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight, slots: int) -> bool:
    """One token with contiguous expert weights (dense, or ``Fp8Weight`` data) of the activations'
    (model) dtype and at most ``MAX_SLOTS`` slots."""
    dense = [w.data if isinstance(w, Fp8Weight) else w for w in (w_gate_up, w_down)]
    return (
        x.shape[0] == 1 and slots <= MAX_SLOTS
        and all(w.is_contiguous() for w in dense) and x.dtype == w_gate_up.dtype == w_down.dtype
    )  # fmt: skip


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, ids: torch.Tensor, act: torch.Tensor,
                   c: MoeTokenConfig, route: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
                   partial: tuple[torch.Tensor, float, torch.Tensor] | None = None, pdl: bool = False) -> None:  # fmt: skip
    """The gate/up stage into ``act`` ``[S, I]``. With ``route`` (router
    logits ``[1, E + 1]``, weights out ``[1, S]``, renormalise) the kernel routes and writes ``ids``
    and the weights itself. With ``partial`` (the MoE norm's weight and eps, the accumulator of
    ``kernels/moe/route_partial.py``) as well, ``x`` is the residual sum ``s``: the kernel normalises it
    and computes the logits from the accumulator, writing them into ``route``'s logits (an output
    then). ``w_gate_up`` ``[E + 1, 2I, H]`` dense or block FP8 (``triton_fp8``)."""
    num_slots, inter = act.shape
    hidden = x.shape[1]
    blocks = triton.cdiv(inter, c.block_n)
    per_slot = balanced_grid(blocks, c.programs_per_sm, x.device, share=num_slots)
    logits, tw, renormalize = route if route is not None else (x, x, False)
    if partial is not None and route is None:
        raise ValueError("partial: the router's accumulator needs route's logits and weights buffers too")
    norm_w, eps, acc = partial if partial is not None else (x, 0.0, ids)
    experts = w_gate_up.shape[0] - 1
    if route is not None and (logits.shape[1] != experts + 1 or logits.stride(-1) != 1
                              or not 2 <= num_slots <= experts + 1 or experts > MAX_EXPERTS):  # fmt: skip
        raise ValueError(f"need unit-stride logits [1, E + 1] for E + 1 = {experts + 1} experts, 1 <= top_k <= E <= {MAX_EXPERTS}, "
                         f"got logits {tuple(logits.shape)} strides {logits.stride()}, {num_slots - 1} routed slots")  # fmt: skip
    w, w_scale, fp8 = expert_operand(w_gate_up)
    _gate_up_token_kernel[(num_slots * per_slot,)](
        x, w, w_scale, ids, act, logits, tw, w_gate_up.shape[0] - 1, per_slot, norm_w, eps, acc, ROUTE_SCALE,
        S=num_slots, H=hidden, INTER=inter, KP=triton.next_power_of_2(hidden), BLOCK_N=c.block_n,
        ROUTE=route is not None, BE=triton.next_power_of_2(w_gate_up.shape[0] - 1) if route is not None else 1,
        BR=triton.next_power_of_2(max(num_slots - 1, 1)), RENORMALIZE=renormalize,
        PARTIAL=partial is not None, COPIES=ROUTE_COPIES, FP8=fp8,
        num_warps=c.num_warps, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
