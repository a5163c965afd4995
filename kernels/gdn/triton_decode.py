"""Gated delta rule decode step over slot-addressed state: Triton version of
``kernels.gdn.reference.recurrent_gated_delta_rule``.

Shapes (as the reference): ``q``, ``k`` ``[B, Hk, Dk]``; ``v`` ``[B, Hv, Dv]``; ``g`` ``[B, Hv]`` fp32 log
decay; ``beta`` ``[B, Hv]``; ``ssm_states`` ``[num_slots, Hv, Dk, Dv]`` (fp32) with unit stride on ``Dv``;
``read_slots``, ``write_slots`` ``[B]`` int64. Returns ``[B, Hv, Dv]`` in ``v.dtype``. q/k/v may be
strided views (the conv output split into q|k|v) as long as their last dim is contiguous.

One program per (sequence, value head, block of ``BV`` value columns) fuses what the reference does
in ~15 torch ops: gather the ``[Dk, BV]`` state tile from ``read_slots[i]``, L2-normalise q and k
(eps 1e-6) and scale q by ``Dk ** -0.5``, decay, delta-rule write, output, and store the tile to
``write_slots[i]``. Value head ``h`` reads key head ``h // (Hv // Hk)``; all math is fp32.

Read-before-write: a program loads its whole tile before a CTA barrier and stores it after, so
``read_slots[i] == write_slots[i]`` updates in place. Across sequences the kernel cannot order
programs: ``write_slots`` must be distinct and no sequence may write a slot another one reads in
the same call (the engine's copy-on-write never does; the reference would tolerate it).

Memory traffic at the 35B-A3B decode shape (Hk 16, Hv 32, Dk = Dv = 128), per layer and sequence:
state 2 MiB read + 2 MiB written (fp32), q/k/v/out 4 x 8 KiB in bf16, g/beta 256 B: ~4.03 MiB.
Batch 1 is latency-bound (128 programs); large batches run near the memory bandwidth.
``GdnDecodeConfig()`` (``BV`` 32, 4 warps) is the tile a sweep of ``BV`` 8-64 x 1-8 warps chose
(``docs/decisions.md``).

``recurrent_gated_delta_rule_with_gates`` (the reference of the same name) takes the raw ``a``/``b``
projections and computes the gates in the same program (``FROM_GATES``): ``g = -exp(A_log) *
softplus(a + dt_bias)`` in fp32 and ``beta = sigmoid(b)`` rounded to ``b``'s dtype, as
``kernels.gdn.reference.gdn_gates`` does; the separate gates launch of each GDN layer is gone at decode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["GdnDecodeConfig", "recurrent_gated_delta_rule", "recurrent_gated_delta_rule_with_gates"]

# Same epsilon as kernels.gdn.reference (HF's l2norm).
_L2_EPS = 1e-6


class GdnDecodeConfig(NamedTuple):
    """Value columns of the state per program (at most) and warps."""

    block_v: int = 32
    num_warps: int = 4


# A [128, 32] fp32 state tile is 32 registers a thread over 4 warps.
_CONFIG = GdnDecodeConfig()


@triton.jit
def recurrent_gated_delta_rule_kernel(
    q,
    k,
    v,
    g,
    beta,
    ssm_states,
    read_slots,
    write_slots,
    o,
    s_qb,
    s_qh,
    s_kb,
    s_kh,
    s_vb,
    s_vh,
    s_gb,
    s_betab,
    s_sn,
    s_sh,
    s_sk,
    q_divisor,
    eps,
    a_log,
    dt_bias,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FROM_GATES: tl.constexpr, PDL: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_v = tl.program_id(2).to(tl.int64)
    i_hk = i_h // GROUP
    num_heads = tl.num_programs(1).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_h = m_k[:, None] & m_v[None, :]
    # The state tile before the wait: the slots are step inputs and the state at the read slot is
    # written by no kernel of the step before this one (its last writer is this layer's step
    # before), so its 16 KiB per program stream in while the projection before finishes.
    i_read = tl.load(read_slots + i_b).to(tl.int64)
    i_write = tl.load(write_slots + i_b).to(tl.int64)
    o_h = i_h * s_sh + o_k[:, None] * s_sk + o_v[None, :]
    b_h = tl.load(ssm_states + i_read * s_sn + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BK, BV]
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)

    b_q = tl.load(q + i_b * s_qb + i_hk * s_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_b * s_kb + i_hk * s_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_b * s_vb + i_h * s_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    if FROM_GATES:
        # ``g`` and ``beta`` point at the raw ``a`` and ``b`` projections (kernels.gdn.reference.gdn_gates).
        b_x = tl.load(g + i_b * s_gb + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
        b_sp = tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(b_x)))  # torch's softplus threshold
        b_g = -tl.exp(tl.load(a_log + i_h).to(tl.float32)) * b_sp
        b_raw = tl.load(beta + i_b * s_betab + i_h)
        b_beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    else:
        b_g = tl.load(g + i_b * s_gb + i_h).to(tl.float32)
        b_beta = tl.load(beta + i_b * s_betab + i_h).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + eps) / q_divisor
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + eps)

    b_h = b_h * tl.exp(b_g)
    b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta  # [BV]
    b_h = b_h + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)  # [BV]

    tl.store(o + (i_b * num_heads + i_h) * DV + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    # Every thread of the program has loaded its part of the tile before any writes it back.
    tl.debug_barrier()
    tl.store(ssm_states + i_write * s_sn + o_h, b_h.to(ssm_states.dtype.element_ty), mask=m_h)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    pdl: bool = False,
    config: GdnDecodeConfig | None = None,
) -> torch.Tensor:
    """Decode, one token per sequence (always from a stored state): ``[B, Hv, Dv]`` in ``v.dtype``.
    ``config``: the launch's tiles (benchmark sweeps; None: ``GdnDecodeConfig()``)."""
    return _launch(q, k, v, g, beta, ssm_states, read_slots, write_slots, None, pdl, config or _CONFIG)


def recurrent_gated_delta_rule_with_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    pdl: bool = False,
    config: GdnDecodeConfig | None = None,
) -> torch.Tensor:
    """The decode step with its gates computed in the kernel from ``a``, ``b`` ``[B, Hv]``."""
    gates = (A_log.contiguous(), dt_bias.contiguous())
    return _launch(q, k, v, a, b, ssm_states, read_slots, write_slots, gates, pdl, config or _CONFIG)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    gates: tuple[torch.Tensor, torch.Tensor] | None,
    pdl: bool,
    config: GdnDecodeConfig,
) -> torch.Tensor:
    """One launch; with ``gates`` (``A_log``, ``dt_bias``) ``g`` and ``beta`` are the raw ``a`` and ``b``."""
    num_seqs, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    if num_v_heads % num_k_heads:
        raise ValueError(f"v heads must be a multiple of q/k heads, got Hv={num_v_heads}, Hk={num_k_heads}")
    if ssm_states.shape[1:] != (num_v_heads, k_dim, v_dim) or ssm_states.stride(-1) != 1:
        raise ValueError(
            f"ssm_states must be [num_slots, {num_v_heads}, {k_dim}, {v_dim}] with unit last stride, "
            f"got shape {tuple(ssm_states.shape)} strides {ssm_states.stride()}"
        )
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty((num_seqs, num_v_heads, v_dim), dtype=v.dtype, device=v.device)
    if num_seqs == 0:
        return out
    a_log, dt_bias = gates if gates is not None else (g, g)  # unused without FROM_GATES
    block_v = min(triton.next_power_of_2(v_dim), config.block_v)
    grid = (num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))
    recurrent_gated_delta_rule_kernel[grid](
        q, k, v, g, beta, ssm_states, read_slots, write_slots, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        k_dim**0.5, _L2_EPS, a_log, dt_bias,
        GROUP=num_v_heads // num_k_heads, DK=k_dim, DV=v_dim,
        BK=triton.next_power_of_2(k_dim), BV=block_v, FROM_GATES=gates is not None,
        num_warps=config.num_warps, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out
