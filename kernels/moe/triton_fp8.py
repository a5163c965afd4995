"""Block-FP8 expert weights in the MoE kernels: the operand as a launch passes it, and the tiles
dequantized in registers.

An expert tensor ``[E, N, K]`` reaches an op as a dense tensor in the model dtype or as a
``kernels.linear.fp8.Fp8Weight``: ``data`` ``float8_e4m3fn`` ``[E, N, K]`` and ``scale_inv`` fp32
``[E, N, KB]``, ``KB = ceil(K / 128)``, one scale per row and 128-column block::

    w[e, n, k] = data[e, n, k] * scale_inv[e, n, k // 128]

A kernel compiled with ``FP8`` loads the e4m3 bytes of the experts its programs read (half the
bytes of bf16, which is what bounds decode) together with their tile's scales and dequantizes in
fp32 (``dequant``); no expert is dequantized in memory. Without ``FP8`` the scales' pointer is
the weights' and nothing reads it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.kernels.linear.fp8 import Fp8Weight

__all__ = ["SCALE_BLOCK", "block_scales", "dequant", "expert_operand", "tile_fp32"]

SCALE_BLOCK = 128  # columns per scale (``engine.models._fp8.ROW_BLOCK``)


def expert_operand(w: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(weights, scales, fp8)`` for a launch: an ``Fp8Weight``'s ``data`` and ``scale_inv``
    (checked: ``[E, N, K]`` e4m3 with ``[E, N, ceil(K / 128)]`` fp32 scales; made contiguous, which
    the model's parameters are), or a dense tensor twice (its scales pointer unused)."""
    if not isinstance(w, Fp8Weight):
        return w, w, False
    data, scale = w.data, w.scale_inv
    blocks = triton.cdiv(data.shape[-1], SCALE_BLOCK)
    if (data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or data.dim() != 3
            or scale.shape != (*data.shape[:2], blocks)):  # fmt: skip
        raise ValueError(f"expected float8_e4m3fn [E, N, K] weights with float32 [E, N, ceil(K / 128)] scales, got "
                         f"{data.dtype} {tuple(data.shape)} and {scale.dtype} {tuple(scale.shape)}")  # fmt: skip
    return data.contiguous(), scale.contiguous(), True


@triton.jit
def block_scales(p_s, o_n, m_n, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales of rows ``o_n`` ``[BLOCK_N]`` over columns ``k0 .. k0 + BLOCK_K`` of one expert
    (``p_s`` its ``[N, ceil(K / 128)]`` scales; ``k0`` a multiple of ``BLOCK_K``, a power of two):
    ``[BLOCK_N, BLOCK_K // 128]``, or ``[BLOCK_N, 1]`` where the tile lies in one 128-column block.
    Blocks past ``K`` read 0 (their weights are masked to 0 too)."""
    KB: tl.constexpr = (K + 127) // 128
    SB: tl.constexpr = BLOCK_K // 128 if BLOCK_K > 128 else 1
    o_sb = k0 // 128 + tl.arange(0, SB)
    return tl.load(p_s + o_n[:, None] * KB + o_sb[None, :], mask=m_n[:, None] & (o_sb < KB)[None, :], other=0.0)


@triton.jit
def dequant(b_w, b_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """An e4m3 tile ``[BLOCK_N, BLOCK_K]`` times its ``block_scales`` in fp32: each 128-column
    group of a row by its scale (the reshape keeps the elements in place)."""
    if BLOCK_K > 128:
        SB: tl.constexpr = BLOCK_K // 128
        b_w3 = tl.reshape(b_w.to(tl.float32), [BLOCK_N, SB, 128]) * b_s[:, :, None]
        return tl.reshape(b_w3, [BLOCK_N, BLOCK_K])
    else:
        return b_w.to(tl.float32) * b_s


@triton.jit
def tile_fp32(b_w, b_s, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A weight tile ``[BLOCK_N, BLOCK_K]`` as loaded, in fp32: dequantized by ``b_s`` with ``FP8``,
    else converted (``b_s`` unused)."""
    if FP8:
        return dequant(b_w, b_s, BLOCK_N, BLOCK_K)
    else:
        return b_w.to(tl.float32)
