"""RMSNorm modules: they own the weights; the kernel op table (``kernels.dispatch``) owns the numerics."""

from __future__ import annotations

import torch
from torch import nn

from phloem.kernels.dispatch import KernelOps

__all__ = ["GatedRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (scale ``1 + weight``) of the layer, final and QK norms."""

    def __init__(self, dim: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.rms_norm(x, self.weight, self.eps)
        return out

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``residual=None`` starts the stream at ``x``."""
        normed, res = self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        return normed, res


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain weight (ones at init), then ``* silu(gate)``."""

    def __init__(self, dim: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.gated_rms_norm(x, gate, self.weight, self.eps)
        return out
