"""RMSNorm modules: they own the weights; the kernel op table (``kernels.dispatch``) owns the numerics."""

from __future__ import annotations

import torch
from torch import nn

from phloem.engine.parallel.group import TPGroup
from phloem.kernels.dispatch import KernelOps

__all__ = ["GatedRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm (scale ``1 + weight``) of the layer, final and QK norms.

    ``tp`` is the group whose ranks' partial sums ``forward_residual`` receives (the layer and final
    norms under tensor parallelism): it reduces them in the same kernel as the add and the norm.
    """

    def __init__(self, dim: int, eps: float, ops: KernelOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.ops = ops
        self.tp = tp if tp is not None else TPGroup.single()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.rms_norm(x, self.weight, self.eps)
        return out

    def forward_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``residual=None`` starts the stream at ``x``.

        Under tensor parallelism ``x`` is this rank's partial sum and is all-reduced first."""
        return self.tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.ops.add_rms_norm)

    def reduce(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The operands for an op that runs this norm's add + norm as its prologue (the fused
        one-token projections): unchanged at TP=1; under tensor parallelism ``x``, this rank's
        partial sum, reduced first (``TPGroup.reduce_norm_operands``)."""
        return self.tp.reduce_norm_operands(x, residual, self.weight, self.eps)


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
