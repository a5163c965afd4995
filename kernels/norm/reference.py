"""RMS norms of Qwen3-Next / Qwen3.5, matching Hugging Face numerics.

Shapes: ``x``, ``residual`` and ``gate`` are ``[..., D]``; ``weight`` is ``[D]``. The norm is taken
over the last dim in fp32 and the result is returned in ``x.dtype``.

Two weight conventions coexist in these checkpoints:

- ``rms_norm`` / ``add_rms_norm`` (layer, q/k and final norms): weights are stored zero-centred,
  the scale is ``1 + weight``, applied in fp32 before the cast back.
- ``gated_rms_norm`` (GDN output norm): weights are plain (ones at init) and applied after the
  cast back to the input dtype, then the fp32 ``silu(gate)`` multiplies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "all_reduce_add_rms_norm", "gated_rms_norm", "rms_norm"]


def _normalize_fp32(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (_normalize_fp32(x, eps) * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``; the sum is rounded to ``x.dtype`` first."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def all_reduce_add_rms_norm(
    parts: Sequence[torch.Tensor], residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(sum(parts), residual)``: the ranks' partial sums added in fp32 in rank order and
    rounded to their dtype (the reference of ``kernels.norm.triton_allreduce``; for two ranks this is
    exactly a bf16 all-reduce's sum)."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    total = total.to(parts[0].dtype)
    return add_rms_norm(total, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The weight multiplies in the input dtype (as HF does), so bf16 rounds twice before the gate.
    normed = weight * _normalize_fp32(x, eps).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)
