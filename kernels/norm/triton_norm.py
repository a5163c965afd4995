"""RMS norms of Qwen3-Next / Qwen3.5: Triton versions of ``kernels.norm.reference``.

Shapes (as the references): ``x``, ``residual``, ``gate`` ``[..., D]``, ``weight`` ``[D]``; outputs are
new contiguous tensors of ``x``'s shape. Inputs may be strided as long as the leading dims flatten
to rows of one stride with a unit last stride (e.g. the query half of ``q_proj``'s output);
otherwise they are copied first. One program normalises one row of ``D`` in fp32.

- ``rms_norm``: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` (zero-centred weight) in fp32, one cast.
- ``add_rms_norm``: fuses the residual add: one pass reads ``x`` and ``residual`` and writes both
  ``x + residual`` (rounded to the promoted dtype, as torch) and its norm, where the reference runs
  ~8 kernels and re-reads the sum. ``residual=None`` returns ``(rms_norm(x), x)``.
- ``gated_rms_norm``: GDN output norm; the normalised row is rounded to ``x.dtype``, multiplied by the
  plain weight (rounded to the promoted dtype of weight and x), then by ``silu(gate)`` in fp32.

Memory traffic at the 35B-A3B decode shape (bf16, one token): ``add_rms_norm`` over hidden 2048
reads 2 x 4 KiB + the 4 KiB weight and writes 2 x 4 KiB (20 KiB); ``gated_rms_norm`` over 32 value
heads of 128 reads x and gate (2 x 8 KiB) + 256 B weight, writes 8 KiB (~24 KiB). Both are
launch-bound at decode, so one launch each replaces the reference's chain of elementwise ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]


@triton.jit
def rms_norm_kernel(x, weight, o, s_x, D, eps, BD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_r * s_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    tl.store(o + i_r * D + o_d, (b_x * b_rstd * (1.0 + b_w)).to(o.dtype.element_ty), mask=m_d)


@triton.jit
def add_rms_norm_kernel(
    x, residual, weight, o, o_residual, s_x, s_r, D, eps, BD: tl.constexpr, PDL: tl.constexpr
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_r * s_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_res = tl.load(residual + i_r * s_r + o_d, mask=m_d, other=0.0).to(tl.float32)
    # The norm reads the sum as stored (rounded), exactly as the reference re-reads it.
    b_sum = (b_x + b_res).to(o_residual.dtype.element_ty)
    tl.store(o_residual + i_r * D + o_d, b_sum, mask=m_d)
    b_sum = b_sum.to(tl.float32)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_sum * b_sum) / D + eps)
    tl.store(o + i_r * D + o_d, (b_sum * b_rstd * (1.0 + b_w)).to(o.dtype.element_ty), mask=m_d)


@triton.jit
def gated_rms_norm_kernel(
    x, gate, weight, o, s_x, s_g, D, eps, BD: tl.constexpr, ROUND_WEIGHTED: tl.constexpr, PDL: tl.constexpr
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_r = tl.program_id(0).to(tl.int64)
    x_dtype = x.dtype.element_ty
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_r * s_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_g = tl.load(gate + i_r * s_g + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    b_y = b_w * (b_x * b_rstd).to(x_dtype).to(tl.float32)
    if ROUND_WEIGHTED:
        b_y = b_y.to(x_dtype).to(tl.float32)
    b_y = b_y * (b_g / (1.0 + tl.exp(-b_g)))
    tl.store(o + i_r * D + o_d, b_y.to(o.dtype.element_ty), mask=m_d)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[N, D]`` with unit last stride; a view whenever the strides allow it."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _launch_config(dim: int) -> dict[str, int]:
    block_d = triton.next_power_of_2(dim)
    return {"BD": block_d, "num_warps": 4 if block_d <= 1024 else 8}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = _rows(x)
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, rows.stride(0), x.shape[-1], eps, **_launch_config(x.shape[-1]),
            PDL=pdl, launch_pdl=pdl,
        )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to its dtype first."""
    if residual is None:
        return rms_norm(x, weight, eps, pdl), x
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    if x.shape != shape or residual.shape != shape:
        raise ValueError(f"x and residual must have one shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    dtype = torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(shape, dtype=dtype, device=x.device)
    out_residual = torch.empty(shape, dtype=dtype, device=x.device)
    x_rows, res_rows = _rows(x), _rows(residual)
    if x_rows.shape[0]:
        add_rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, res_rows, weight.contiguous(), out, out_residual,
            x_rows.stride(0), res_rows.stride(0), shape[-1], eps, **_launch_config(shape[-1]), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out, out_residual


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False
) -> torch.Tensor:
    if x.shape != gate.shape:
        raise ValueError(f"x and gate must have one shape, got {tuple(x.shape)} and {tuple(gate.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x_rows, gate_rows = _rows(x), _rows(gate)
    if x_rows.shape[0]:
        gated_rms_norm_kernel[(x_rows.shape[0],)](
            x_rows, gate_rows, weight.contiguous(), out,
            x_rows.stride(0), gate_rows.stride(0), x.shape[-1], eps,
            ROUND_WEIGHTED=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
            **_launch_config(x.shape[-1]), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out
