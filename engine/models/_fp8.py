"""Block-FP8 weights inside the existing layers (the dequantize-to-bf16 reference path).

A projection weight ``P`` ``[..., N, K]`` (``nn.Linear.weight`` or an expert tensor) becomes FP8 in
two steps, both done by ``engine.loader``:

1. ``make_fp8(module, "weight")`` before loading: ``P`` is replaced by an ``float8_e4m3fn``
   parameter of the same shape and a sibling fp32 parameter ``P_scale_inv`` ``[..., N, ceil(K/128)]``
   is added, so the loader fills both by name like any parameter.
2. ``dequantize_on_read(module, "weight")`` after loading: a ``torch.nn.utils.parametrize``
   parametrization takes both; ``module.weight`` then returns the weight dequantized to the model
   dtype on every read (``kernels.linear.reference.fp8_block_dequant``), so every op that takes
   ``module.weight`` (an unfused projection's ``nn.Linear`` call) runs unchanged on the
   dequantized weight. Only the FP8 bytes and the scales stay resident.

The fused one-token projections and the routed experts' ops take ``weight_operand(module, name)``
instead: an ``Fp8Weight`` over the stored bytes and scales, which the Triton GEMV and expert
kernels read as they are (dequantized in registers) and the torch references dequantize
(``kernels.linear.triton_gemv``, ``kernels.moe.triton_fp8``, the ``reference`` modules).

A prefill or batched step's dense projection goes through ``project``: with ``KernelConfig.fp8_w8a8``
an FP8 weight is handed as stored (``weight_operand``) to the W8A8 GEMM (activations quantized per
token and 128-column group, ``kernels.linear.w8a8``), else it is read dequantized as above.

Scale layout: one scale per row and 128-column block, i.e. ``block = (1, 128)``. A checkpoint's
``128 x 128`` block scales are expanded along the rows when loaded, so the loader's row
operations (fused ``q|k|v`` rows, Qwen3-Next's per-head regrouping, expert halves, TP row shards)
apply to a weight and its scale alike, at any row offset. The cost is ``4 / 128`` bytes per weight
(3 %) over the published ``4 / 16384``; a fast kernel can compact them where row blocks align.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.utils import parametrize

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_dequant

if TYPE_CHECKING:
    from phloem.kernels.dispatch import KernelOps

__all__ = [
    "FP8_BLOCK", "FP8_DTYPE", "ROW_BLOCK", "Fp8Dequant", "dequantize_on_read", "make_fp8", "project",
    "scale_name", "weight_operand",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = (128, 128)  # the checkpoints' tiles
ROW_BLOCK = (1, 128)  # the tiles as stored here: scales expanded along the rows


def scale_name(param: str) -> str:
    """``qkv_proj.weight`` -> ``qkv_proj.weight_scale_inv``; ``experts.down_proj`` -> ``experts.down_proj_scale_inv``."""
    return param + "_scale_inv"


def make_fp8(module: nn.Module, name: str) -> None:
    """Replaces ``module.<name>`` by an FP8 parameter of its shape and adds ``<name>_scale_inv``
    (fp32, ``[..., N, ceil(K / 128)]``), both on the parameter's device, contents undefined."""
    old = getattr(module, name)
    *lead, k = old.shape
    blocks = -(-k // ROW_BLOCK[1])
    weight = torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device)
    scale = torch.empty((*lead, blocks), dtype=torch.float32, device=old.device)
    delattr(module, name)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=False))
    module.register_parameter(scale_name(name), nn.Parameter(scale, requires_grad=False))


class Fp8Dequant(nn.Module):
    """``module.<name>`` read as ``fp8_block_dequant(fp8 weight, scale_inv, (1, 128), dtype)``."""

    def __init__(self, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        self.dtype = dtype

    def forward(self, w_fp8: torch.Tensor) -> torch.Tensor:
        return fp8_block_dequant(w_fp8, self.scale_inv, ROW_BLOCK, self.dtype)


def dequantize_on_read(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Moves ``<name>_scale_inv`` into a parametrization of ``<name>`` that dequantizes to ``dtype``."""
    scale = getattr(module, scale_name(name)).data
    delattr(module, scale_name(name))
    parametrize.register_parametrization(module, name, Fp8Dequant(scale, dtype), unsafe=True)


def is_fp8(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is stored as block FP8 (after ``dequantize_on_read``)."""
    return parametrize.is_parametrized(module, name) and any(
        isinstance(p, Fp8Dequant) for p in module.parametrizations[name]  # type: ignore[union-attr,index]
    )


def weight_operand(module: nn.Module, name: str) -> torch.Tensor | Fp8Weight:
    """What an op that reads FP8 weights takes for ``module.<name>``: an ``Fp8Weight`` over the
    stored FP8 bytes and scales (no dequantization) when it is block FP8, else the tensor itself."""
    if not is_fp8(module, name):
        return getattr(module, name)  # type: ignore[no-any-return]
    parts = module.parametrizations[name]  # type: ignore[union-attr,index]
    deq = next(p for p in parts if isinstance(p, Fp8Dequant))
    return Fp8Weight(parts.original, deq.scale_inv, deq.dtype)


def project(ops: KernelOps, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, the projection of a prefill or batched step; with ``ops.fp8_w8a8`` a block-FP8
    ``module.weight`` goes to ``ops.fp8_w8a8_linear`` as stored (W8A8: activations quantized per
    token and 128-column group, the FP8 GEMM) instead of being dequantized on read."""
    if ops.fp8_w8a8 and is_fp8(module, "weight"):
        out: torch.Tensor = ops.fp8_w8a8_linear(x, weight_operand(module, "weight"))
        return out
    result: torch.Tensor = module(x)
    return result
