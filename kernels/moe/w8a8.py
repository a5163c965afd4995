"""W8A8 block-FP8 expert projections (the grouped form of ``kernels.linear.w8a8``): torch reference.

One projection of a MoE layer over its ``(token, slot)`` pairs: pair ``p = t * k + j`` multiplies
its activation row by expert ``topk_ids[t, j]``'s weight ``[N, K]`` (an ``Fp8Weight`` over
``[E, N, K]`` e4m3 with ``scale_inv [E, N, ceil(K / 128)]``). The activation rows are either one per
token (the gate/up stage: every slot of a token reads its row) or one per pair (the down stage),
quantized per row and 128-column group as in ``kernels.linear.w8a8.fp8_act_quant``.
"""

from __future__ import annotations

import torch

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_dequant
from phloem.kernels.linear.w8a8 import FP8_GROUP, fp8_act_quant

__all__ = ["fp8_w8a8_grouped_linear_reference", "pair_sources"]


def pair_sources(num_rows: int, topk_ids: torch.Tensor) -> torch.Tensor:
    """The activation row of each pair ``[T * k]``: its token's with ``T`` rows, its own with ``T * k``.

    Raises:
        ValueError: ``num_rows`` is neither.
    """
    num_tokens, top_k = topk_ids.shape
    pairs = torch.arange(num_tokens * top_k, device=topk_ids.device)
    if num_rows == num_tokens:
        return pairs // top_k
    if num_rows == num_tokens * top_k:
        return pairs
    raise ValueError(f"grouped w8a8: expected {num_tokens} or {num_tokens * top_k} activation rows, got {num_rows}")


def fp8_w8a8_grouped_linear_reference(x: torch.Tensor, weight: Fp8Weight, topk_ids: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T or T * k, K]`` -> ``[T * k, N]`` in ``weight.dtype``: ``x`` quantized by
    ``fp8_act_quant``, each pair's row and its expert's weight dequantized to fp32, one fp32 matmul
    per expert, one rounding."""
    src = pair_sources(x.shape[0], topk_ids)
    x_fp8, x_scale = fp8_act_quant(x)
    a = fp8_block_dequant(x_fp8, x_scale, (1, FP8_GROUP))[src]
    ids = topk_ids.flatten()
    out = torch.zeros(ids.numel(), weight.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        w = fp8_block_dequant(weight.data[e], weight.scale_inv[e], (1, FP8_GROUP))
        out[ids == e] = a[ids == e] @ w.T
    return out.to(weight.dtype)
