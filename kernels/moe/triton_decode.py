"""Fused MoE experts for small batches (decode): grouped GEMV straight from the expert weights.

Same signature and semantics as ``kernels.moe.reference.fused_moe``. The torch reference loops over the
experts a batch hits, with data-dependent shapes (not capturable in a CUDA graph) and one launch
per expert. Here two launches serve every (token, top-k slot) pair at once, each program reading
its expert's rows by index, so the bytes moved are the top-k experts' weights once:

    stage 1  act[t, j, n] = silu(x[t] · Wg[e][n]) * (x[t] · Wu[e][n])      e = topk_ids[t, j]
    stage 2  out[t, m]    = Σ_j topk_weights[t, j] * (act[t, j] · Wd[e][m])

Stage 2 sums the ``k`` experts inside the kernel: a program owns ``BLOCK_N`` output columns of one
token and walks its experts' down rows in one flat loop (so the software pipeline prefetches
across expert boundaries), writing the token's output once in ``x.dtype`` — no fp32 partials,
no separate reduction and cast launches, no atomics (the sum order is fixed: deterministic).

``fused_moe_routed`` takes the router logits instead of the weights and ids: each gate/up program
finds its slot's expert itself (``triton_route.select_expert``) and one program per token writes the
weights and ids stage 2 reads, so the routing needs no launch of its own (the one-token decode
path; with more tokens the routing in every program costs more than the launch it saves).

One token (batch-1 decode) takes stage 1 from ``kernels.moe.triton_token`` (a slot-major grid of
programs walking their slot's blocks, each routing once: ``fused_moe_token`` /
``fused_moe_token_routed``, and ``fused_moe_token_route_partial`` from the router partial's
accumulator, ``kernels/moe/route_partial.py``, which stage 2 zeroes after its wait), then stage 2
here with its own tiles and a walk that keeps the next step's tile and the ids a step further
ahead in flight (``PREFETCH``). More tokens walk one tile at a time (the prefetching walk was
measured at one token only).

At the Qwen3.5-35B-A3B decode shape (H=2048, I=512, top-8 + shared) one token reads
9 × 3 × 2048 × 512 bf16 = 57 MB per layer, which is what bounds decode. Accumulation is fp32.

Block-FP8 experts (``Fp8Weight``: e4m3 ``[E, N, K]``, fp32 scales ``[E, N, ceil(K / 128)]``) halve
that: both stages (and ``triton_token``'s) compile with ``FP8`` and load each tile's e4m3 bytes
with its rows' scales, dequantizing in registers (``triton_fp8``); activations stay in ``x.dtype``.
Each stage reads its own operand, so one projection may be FP8 and the other dense.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe import triton_token
from phloem.kernels.moe.triton_fp8 import block_scales, expert_operand, tile_fp32
from phloem.kernels.moe.triton_route import MAX_EXPERTS, route_row, select_expert

__all__ = [
    "DEFAULT_CONFIG",
    "MoeDecodeConfig",
    "fused_moe",
    "fused_moe_routed",
    "fused_moe_token",
    "fused_moe_token_route_partial",
    "fused_moe_token_routed",
    "fused_moe_tuned",
    "launch_down_sum",
    "launch_gate_up",
]


class MoeDecodeConfig(NamedTuple):
    """Tile sizes, warps and pipeline stages of the two stages (``1`` = gate/up, ``2`` = down)."""

    block_n1: int
    block_k1: int
    num_warps1: int
    num_stages1: int
    block_n2: int
    block_k2: int
    num_warps2: int
    num_stages2: int


@triton.jit
def _gate_up_kernel(
    p_x, p_w, p_s, p_ids, p_act, p_logits, p_tw, s_lt, E,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, RENORMALIZE: tl.constexpr, FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_pair = tl.program_id(0).to(tl.int64)  # token * TOP_K + j
    i_n = tl.program_id(1).to(tl.int64)
    i_tok = i_pair // TOP_K
    if ROUTE:
        # TOP_K slots = the routed top-(TOP_K - 1) + the shared expert E; each program finds its
        # slot's expert from the router logits, and one program per token writes the weights and
        # ids the down stage reads.
        j = i_pair % TOP_K
        p_row = p_logits + i_tok * s_lt
        if j == TOP_K - 1:
            e = E.to(tl.int64)
            if i_n == 0:
                route_row(p_row, p_tw + i_tok * TOP_K, p_ids + i_tok * TOP_K, E, TOP_K - 1, BE, BR, RENORMALIZE, True)
        else:
            e = select_expert(p_row, j, E, BE).to(tl.int64)
    else:
        e = tl.load(p_ids + i_pair).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < INTER
    # Elementwise accumulators, reduced once at the end: a cross-lane reduction per K step
    # would serialise the loads behind shuffles.
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    p_we = p_w + e * (2 * INTER * H)
    KB: tl.constexpr = (H + 127) // 128
    p_se = p_s + e * (2 * INTER * KB)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(p_x + i_tok * H + o_k, mask=m_k, other=0.0).to(tl.float32)
        m_w = m_n[:, None] & m_k[None, :]
        b_wg = tl.load(p_we + o_n[:, None] * H + o_k[None, :], mask=m_w, other=0.0)
        b_wu = tl.load(p_we + (o_n[:, None] + INTER) * H + o_k[None, :], mask=m_w, other=0.0)
        if FP8:
            b_sg = block_scales(p_se, o_n, m_n, k0, H, BLOCK_K)
            b_su = block_scales(p_se + INTER * KB, o_n, m_n, k0, H, BLOCK_K)
        else:
            b_sg, b_su = b_wg, b_wu
        acc_g += tile_fp32(b_wg, b_sg, FP8, BLOCK_N, BLOCK_K) * b_x[None, :]
        acc_u += tile_fp32(b_wu, b_su, FP8, BLOCK_N, BLOCK_K) * b_x[None, :]
    b_g = tl.sum(acc_g, axis=1)
    b_u = tl.sum(acc_u, axis=1)
    b_act = b_g * tl.sigmoid(b_g) * b_u
    tl.store(p_act + i_pair * INTER + o_n, b_act.to(p_act.dtype.element_ty), mask=m_n)


@triton.jit
def _down_operands(p_act, p_w, p_s, i_pair, e, s, o_n, m_n, o_kb, H: tl.constexpr, INTER: tl.constexpr,
                   K_BLOCKS: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, ok):  # fmt: skip
    """Step ``s`` of the walk (slot ``s // K_BLOCKS``, expert ``e``): the slot's activations and the
    expert's down tile, both ``[BLOCK_N, BLOCK_K]`` as loaded (zeros if not ``ok``), and with ``FP8``
    the tile's scales (else the tile again, unused). Nothing here uses a loaded value, so a load
    issued ahead is waited for only where its step reduces it."""
    k0 = (s % K_BLOCKS) * BLOCK_K
    o_k = (k0 + o_kb)[None, :]
    m_k = (o_k < INTER) & ok
    p_we = p_w + e * (H * INTER)
    b_w = tl.load(p_we + o_n[:, None] * INTER + o_k, mask=m_n[:, None] & m_k, other=0.0)
    if FP8:
        KB: tl.constexpr = (INTER + 127) // 128
        b_s = block_scales(p_s + e * (H * KB), o_n, m_n & ok, k0, INTER, BLOCK_K)
    else:
        b_s = b_w
    # The activations loaded once a row of the tile (L1 hits after the first): in the tile's own
    # layout, so no step converts them through shared memory.
    o_k2 = o_k + tl.zeros_like(o_n)[:, None]
    b_a = tl.load(p_act + i_pair * INTER + o_k2, mask=m_n[:, None] & m_k, other=0.0)
    return b_a, b_w, b_s


@triton.jit
def _down_sum_kernel(
    p_act, p_w, p_s, p_ids, p_tw, p_out, p_zero, N_ZERO,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_tok = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    if ZERO_BLOCK > 0:
        # The router's accumulator back to zero (kernels/moe/route_partial.py): the gate/up stage, which
        # read it, has ended (the wait above).
        o_z = i_n * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
        tl.store(p_zero + o_z, tl.zeros([ZERO_BLOCK], dtype=p_zero.dtype.element_ty), mask=(o_z < N_ZERO) & (i_tok == 0))
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    o_kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    STEPS: tl.constexpr = TOP_K * K_BLOCKS
    i_pair0 = i_tok * TOP_K
    if PREFETCH:
        # The next step's tile and activations in flight while one is reduced (as the GEMVs), and
        # the ids and weights one step further ahead, so a tile's load never waits on the load of
        # its own id. The slot weight multiplies where the step reduces, as below.
        p_ids_t, p_tw_t = p_ids + i_pair0, p_tw + i_pair0
        e = tl.load(p_ids_t).to(tl.int64)
        b_tw = tl.load(p_tw_t).to(tl.float32)
        b_a, b_w, b_s = _down_operands(p_act, p_w, p_s, i_pair0, e, 0, o_n, m_n, o_kb, H, INTER, K_BLOCKS, BLOCK_K,
                                       FP8, True)  # fmt: skip
        j_next = tl.minimum(1, STEPS - 1) // K_BLOCKS
        e_next = tl.load(p_ids_t + j_next).to(tl.int64)
        b_tw_next = tl.load(p_tw_t + j_next).to(tl.float32)
        for s in range(0, STEPS):
            b_ac, b_wc, b_sc, b_twc = b_a, b_w, b_s, b_tw
            b_a, b_w, b_s = _down_operands(p_act, p_w, p_s, i_pair0 + j_next, e_next, s + 1, o_n, m_n, o_kb, H, INTER,
                                           K_BLOCKS, BLOCK_K, FP8, s + 1 < STEPS)  # fmt: skip
            b_tw = b_tw_next
            j_next = tl.minimum(s + 2, STEPS - 1) // K_BLOCKS
            e_next = tl.load(p_ids_t + j_next).to(tl.int64)
            b_tw_next = tl.load(p_tw_t + j_next).to(tl.float32)
            acc += tile_fp32(b_wc, b_sc, FP8, BLOCK_N, BLOCK_K) * (b_ac.to(tl.float32) * b_twc)
    else:
        # One flat loop over (expert slot j, K block) so loads pipeline across experts (the
        # activations as one row).
        for s in range(0, STEPS):
            i_pair = i_pair0 + s // K_BLOCKS
            e = tl.load(p_ids + i_pair).to(tl.int64)
            b_tw = tl.load(p_tw + i_pair).to(tl.float32)
            o_k = (s % K_BLOCKS) * BLOCK_K + o_kb
            m_k = o_k < INTER
            b_a = tl.load(p_act + i_pair * INTER + o_k, mask=m_k, other=0.0).to(tl.float32) * b_tw
            p_we = p_w + e * (H * INTER)
            b_w = tl.load(p_we + o_n[:, None] * INTER + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            if FP8:
                KB: tl.constexpr = (INTER + 127) // 128
                b_s = block_scales(p_s + e * (H * KB), o_n, m_n, (s % K_BLOCKS) * BLOCK_K, INTER, BLOCK_K)
            else:
                b_s = b_w
            acc += tile_fp32(b_w, b_s, FP8, BLOCK_N, BLOCK_K) * b_a[None, :]
    tl.store(p_out + i_tok * H + o_n, tl.sum(acc, axis=1).to(p_out.dtype.element_ty), mask=m_n)


# The sweep winners at the 35B-A3B shape (``benchmarks/sweeps/moe_sweep.py``): at one token, used for 2
# to _BATCH_TOKENS - 1 tokens, and at 16 tokens, used from _BATCH_TOKENS up. Benchmark tools pass
# another ``MoeDecodeConfig`` to ``fused_moe_tuned`` directly.
DEFAULT_CONFIG = MoeDecodeConfig(4, 1024, 8, 3, 4, 512, 8, 2)
_BATCH_CONFIG = MoeDecodeConfig(4, 1024, 8, 2, 4, 256, 1, 2)
_BATCH_TOKENS = 8
# One token (``fused_moe_token*``: stage 1 is ``triton_token``'s, only the down fields count) with the
# prefetching walk: 1024 programs of 2 rows and 4 warps.
_TOKEN_CONFIG = MoeDecodeConfig(4, 1024, 8, 3, 2, 512, 4, 2)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor | Fp8Weight,  # [E, 2I, H]
    w_down: torch.Tensor | Fp8Weight,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
    pdl: bool = False,
) -> torch.Tensor:
    if topk_ids.shape[0] == 1 and triton_token.covered(x, w_gate_up, w_down, topk_ids.shape[1]):
        return fused_moe_token(x, w_gate_up, w_down, topk_weights, topk_ids, pdl=pdl)
    config = DEFAULT_CONFIG if x.shape[0] < _BATCH_TOKENS else _BATCH_CONFIG
    return fused_moe_tuned(x, w_gate_up, w_down, topk_weights, topk_ids, config, pdl=pdl)


def fused_moe_routed(
    x: torch.Tensor,  # [T, H]
    router_logits: torch.Tensor,  # [T, E + 1]: the routed experts' logits, then the shared gate's
    w_gate_up: torch.Tensor | Fp8Weight,  # [E + 1, 2I, H]
    w_down: torch.Tensor | Fp8Weight,  # [E + 1, H, I]
    top_k: int,
    renormalize: bool,
    pdl: bool = False,
) -> torch.Tensor:
    """``kernels.moe.reference.fused_moe_routed``: the routing (``triton_route.route_row`` / ``select_expert``) in
    the gate/up stage's programs, no launch of its own."""
    num_tokens, num_cols = router_logits.shape
    if num_tokens == 1 and triton_token.covered(x, w_gate_up, w_down, top_k + 1):
        return fused_moe_token_routed(x, router_logits, w_gate_up, w_down, top_k, renormalize, pdl=pdl)
    if not 1 <= top_k <= num_cols - 1 <= MAX_EXPERTS or router_logits.stride(-1) != 1:
        raise ValueError(f"need 1 <= top_k <= E <= {MAX_EXPERTS} and unit-stride logits, got top_k={top_k}, "
                         f"logits {tuple(router_logits.shape)} strides {router_logits.stride()}")  # fmt: skip
    config = DEFAULT_CONFIG if num_tokens < _BATCH_TOKENS else _BATCH_CONFIG
    x = x.contiguous()
    inter = w_down.shape[2]
    ids = torch.empty((num_tokens, top_k + 1), dtype=torch.int64, device=x.device)
    tw = torch.empty((num_tokens, top_k + 1), dtype=router_logits.dtype, device=x.device)
    act = torch.empty((num_tokens * (top_k + 1), inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    launch_gate_up(x, w_gate_up, ids, act, config, (router_logits, tw, renormalize), pdl=pdl)
    launch_down_sum(act, w_down, ids, tw, out, config, pdl=pdl)
    return out


def fused_moe_token(
    x: torch.Tensor,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: triton_token.MoeTokenConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``fused_moe`` of one token (``triton_token.covered``): ``triton_token``'s gate/up, then down + sum."""
    ids, tw = topk_ids.contiguous(), topk_weights.contiguous()
    act, out = _token_buffers(x, w_down, ids.shape[1])
    triton_token.launch_gate_up(x.contiguous(), w_gate_up, ids, act, config or triton_token.DEFAULT_CONFIG, pdl=pdl)
    launch_down_sum(act, w_down, ids, tw, out, _TOKEN_CONFIG, prefetch=True, pdl=pdl)
    return out


def fused_moe_token_routed(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    top_k: int,
    renormalize: bool,
    config: triton_token.MoeTokenConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``fused_moe_routed`` of one token: the routing inside ``triton_token``'s gate/up programs."""
    return _routed_token(x, router_logits, w_gate_up, w_down, top_k, renormalize, config, None, pdl)


def fused_moe_token_route_partial(
    s: torch.Tensor,
    acc: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    top_k: int,
    renormalize: bool,
    config: triton_token.MoeTokenConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``kernels.moe.route_partial.fused_moe_route_partial`` of one token: the norm and the logits in
    ``triton_token``'s gate/up programs (which write the logits into a buffer of their own), the
    accumulator zeroed by the down stage."""
    logits = torch.empty((1, w_gate_up.shape[0]), dtype=s.dtype, device=s.device)
    return _routed_token(s, logits, w_gate_up, w_down, top_k, renormalize, config, (norm_w, eps, acc), pdl)


def _routed_token(
    x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, w_down: torch.Tensor | Fp8Weight,
    top_k: int,
    renormalize: bool, config: triton_token.MoeTokenConfig | None,
    partial: tuple[torch.Tensor, float, torch.Tensor] | None, pdl: bool,
) -> torch.Tensor:  # fmt: skip
    """One token's gate/up (routing in its programs; ``partial``: ``triton_token.launch_gate_up``'s),
    then the down stage (zeroing ``partial``'s accumulator)."""
    slots = top_k + 1
    ids = torch.empty((1, slots), dtype=torch.int64, device=x.device)
    tw = torch.empty((1, slots), dtype=logits.dtype, device=x.device)
    act, out = _token_buffers(x, w_down, slots)
    c = config or (triton_token.PARTIAL_CONFIG if partial is not None else triton_token.DEFAULT_CONFIG)
    triton_token.launch_gate_up(x.contiguous(), w_gate_up, ids, act, c, (logits, tw, renormalize), partial, pdl=pdl)
    zero = partial[2] if partial is not None else None
    launch_down_sum(act, w_down, ids, tw, out, _TOKEN_CONFIG, prefetch=True, zero=zero, pdl=pdl)
    return out


def _token_buffers(x: torch.Tensor, w_down: torch.Tensor | Fp8Weight, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty((slots, w_down.shape[2]), dtype=x.dtype, device=x.device), torch.empty_like(x)


def fused_moe_tuned(
    x: torch.Tensor,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeDecodeConfig,
    down_prefetch: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """``fused_moe`` with explicit tile sizes, warps and stages (for sweeps); ``down_prefetch`` as
    ``launch_down_sum``'s ``prefetch``."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w_down.shape[2]
    assert w_gate_up.shape[1:] == (2 * inter, hidden) and w_down.shape[1:] == (hidden, inter), "expert shapes"
    x, ids, tw = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    launch_gate_up(x, w_gate_up, ids, act, config, pdl=pdl)
    launch_down_sum(act, w_down, ids, tw, out, config, prefetch=down_prefetch, pdl=pdl)
    return out


def launch_gate_up(x: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight, ids: torch.Tensor, act: torch.Tensor,
                   c: MoeDecodeConfig, route: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
                   pdl: bool = False) -> None:  # fmt: skip
    """Stage 1 alone into ``act`` ``[T * K, I]`` (sweeps time the stages one by one). With ``route``
    (router logits ``[T, E + 1]``, weights out ``[T, K]``, renormalise) the kernel routes and writes
    ``ids`` and the weights itself."""
    num_tokens, hidden = x.shape
    top_k, inter = ids.shape[1], act.shape[1]
    logits, tw, renormalize = route if route is not None else (x, x, False)
    num_experts = logits.shape[1] - 1 if route is not None else 1
    w, w_scale, fp8 = expert_operand(w_gate_up)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, c.block_n1))](
        x, w, w_scale, ids, act, logits, tw, logits.stride(0), num_experts,
        H=hidden, INTER=inter, TOP_K=top_k, BLOCK_N=c.block_n1, BLOCK_K=c.block_k1,
        ROUTE=route is not None, BE=triton.next_power_of_2(num_experts), BR=triton.next_power_of_2(max(top_k - 1, 1)),
        RENORMALIZE=renormalize, FP8=fp8, num_warps=c.num_warps1, num_stages=c.num_stages1, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip


def launch_down_sum(act: torch.Tensor, w_down: torch.Tensor | Fp8Weight, ids: torch.Tensor, tw: torch.Tensor,
                    out: torch.Tensor, c: MoeDecodeConfig, prefetch: bool = False,
                    zero: torch.Tensor | None = None, pdl: bool = False) -> None:  # fmt: skip
    """Stage 2 alone into ``out`` ``[T, H]``; ``prefetch``: the walk with the next step's tile in
    flight (the one-token path's), else one tile at a time. Same sums bit for bit.
    ``zero`` (contiguous): set to zero after the wait (the router's accumulator,
    ``kernels/moe/route_partial.py``)."""
    num_tokens, hidden = out.shape
    top_k, inter = ids.shape[1], act.shape[1]
    block_k = min(c.block_k2, triton.next_power_of_2(inter))
    grid_n = triton.cdiv(hidden, c.block_n2)
    zero_block = 0 if zero is None else triton.next_power_of_2(triton.cdiv(zero.numel(), grid_n))
    if zero is not None and not zero.is_contiguous():
        raise ValueError("zero: expected a contiguous tensor")
    w, w_scale, fp8 = expert_operand(w_down)
    _down_sum_kernel[(num_tokens, grid_n)](
        act, w, w_scale, ids, tw, out, zero if zero is not None else ids, zero.numel() if zero is not None else 0,
        H=hidden, INTER=inter, TOP_K=top_k, K_BLOCKS=triton.cdiv(inter, block_k),
        BLOCK_N=c.block_n2, BLOCK_K=block_k, PREFETCH=prefetch, ZERO_BLOCK=zero_block, FP8=fp8,
        num_warps=c.num_warps2, num_stages=c.num_stages2,
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
