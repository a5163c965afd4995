"""Block FP8 weights: quantize and dequantize (torch only; ``reference.fp8_block_matmul_reference``
uses them, as do the MoE reference and the loader).

``w_fp8`` ``[..., N, K]`` ``float8_e4m3fn`` with ``scale_inv`` ``[..., ceil(N / bn), ceil(K / bk)]``
fp32, one per ``block = (bn, bk)`` tile (``(128, 128)`` in Qwen's FP8 releases; edge tiles are
partial): the weight is ``w_fp8 * scale_inv`` over each tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["FP8_E4M3_MAX", "Fp8Weight", "dense", "fp8_block_dequant", "fp8_block_quantize"]

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _expand_blocks(scale_inv: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """``[..., ceil(N / bn), ceil(K / bk)]`` -> ``[..., N, K]``: each tile's scale over its elements."""
    bn, bk = block
    n, k = shape[-2], shape[-1]
    if scale_inv.shape[-2] != -(-n // bn) or scale_inv.shape[-1] != -(-k // bk):
        raise ValueError(
            f"scale_inv: expected [..., {-(-n // bn)}, {-(-k // bk)}] for a [..., {n}, {k}] weight in "
            f"{bn}x{bk} blocks, got {tuple(scale_inv.shape)}"
        )
    full = scale_inv.repeat_interleave(bn, dim=-2)[..., :n, :] if bn > 1 else scale_inv
    return full.repeat_interleave(bk, dim=-1)[..., :k] if bk > 1 else full


def fp8_block_dequant(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """``w_fp8 * scale_inv`` (each tile's scale over its tile), computed in fp32, returned in ``dtype``."""
    return (w_fp8.to(torch.float32) * _expand_blocks(scale_inv.to(torch.float32), w_fp8.shape, block)).to(dtype)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8, scale_inv)`` with ``scale_inv = amax(|tile|) / 448`` per tile (1 for an all-zero
    tile) and ``w_fp8 = e4m3(w / scale_inv)`` (round to nearest even, saturating at 448)."""
    bn, bk = block
    n, k = w.shape[-2], w.shape[-1]
    nb, kb = -(-n // bn), -(-k // bk)
    w32 = w.to(torch.float32)
    padded = F.pad(w32, (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (w32 / _expand_blocks(scale_inv, w.shape, block)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale_inv


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A block-FP8 weight as the ops take it, in place of a dense ``[..., N, K]`` tensor.

    ``data`` ``[..., N, K]`` ``float8_e4m3fn``; ``scale_inv`` ``[..., N, ceil(K / 128)]`` fp32, one
    scale per row and 128-column block (``block = (1, 128)``: the loader expands a checkpoint's
    128x128 tiles along the rows, ``engine.models._fp8``); ``dtype`` the model dtype a dense read
    returns. A kernel that reads FP8 weights takes ``data`` and ``scale_inv``; any other op calls
    ``dense()`` (the reference path).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dense(self) -> torch.Tensor:
        """The weight dequantized to ``dtype``: ``data * scale_inv`` over each ``1 x 128`` block."""
        return fp8_block_dequant(self.data, self.scale_inv, (1, 128), self.dtype)


def dense(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """``w`` as a dense tensor: itself, or an ``Fp8Weight`` dequantized."""
    return w.dense() if isinstance(w, Fp8Weight) else w
