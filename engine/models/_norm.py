"""RMSNorm modules over ``kernels.norm``: they own the weights, the kernels own the numerics."""

from __future__ import annotations

import torch
from torch import nn

from phloem.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm

__all__ = ["GatedRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (scale ``1 + weight``) of the layer, final and QK norms."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``residual=None`` starts the stream at ``x``."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain weight (ones at init), then ``* silu(gate)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
