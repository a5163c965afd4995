"""W8A8 block-FP8 linear, the scheme Qwen's FP8 checkpoints are published for (DeepSeek-V3's:
``activation_scheme: dynamic``): torch references.

The weight is an ``Fp8Weight`` (``kernels.linear.fp8``: e4m3 ``[N, K]``, one fp32 scale per row and
128-column block). The activations are quantized at run time, per token and ``group`` = 128-column
group, with the same rule as the weights' blocks (``fp8_block_quantize`` with ``block = (1, group)``)::

    x_scale[m, g] = amax(|x[m, g*128 : (g+1)*128]|) / 448        (1 for an all-zero group)
    x_fp8[m, k]   = e4m3(clamp(x[m, k] / x_scale[m, k // 128], -448, 448))   round to nearest even

so a K block of the product is an e4m3 x e4m3 dot scaled by ``x_scale[m, kb] * scale_inv[n, kb]``:
the tensor-core GEMM of ``triton_w8a8`` reads FP8 operands only and applies both scales per K step.
"""

from __future__ import annotations

import torch

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_dequant, fp8_block_quantize

__all__ = ["FP8_GROUP", "fp8_act_quant", "fp8_w8a8_block_matmul_reference"]

FP8_GROUP = 128  # columns per activation scale; equal to the weights' block width


def fp8_act_quant(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> ``(x_fp8 [M, K] float8_e4m3fn, x_scale [M, ceil(K / group)] fp32)``, per
    token and ``group`` columns (the last group partial when ``group`` does not divide ``K``)."""
    if x.ndim != 2:
        raise ValueError(f"fp8_act_quant: expected x of shape [M, K], got {tuple(x.shape)}")
    return fp8_block_quantize(x, (1, group))


def fp8_w8a8_block_matmul_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """``[..., K]`` -> ``[..., N]`` in ``weight.dtype``: ``x`` quantized by ``fp8_act_quant``, both
    operands dequantized to fp32, one fp32 matmul, one rounding to the model dtype."""
    k = x.shape[-1]
    if weight.data.ndim != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8 w8a8 linear: expected a [N, {k}] weight for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    x_fp8, x_scale = fp8_act_quant(x.reshape(-1, k))
    a = fp8_block_dequant(x_fp8, x_scale, (1, FP8_GROUP))
    b = fp8_block_dequant(weight.data, weight.scale_inv, (1, FP8_GROUP))
    return (a @ b.T).to(weight.dtype).reshape(*x.shape[:-1], weight.shape[0])
