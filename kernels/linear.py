"""A dense projection ``x @ weight.T`` (``[..., K]`` x ``[N, K]`` -> ``[..., N]``): the reference is
``torch.nn.functional.linear``; ``kernels.triton.gemv`` is the single-token GPU version of it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["linear"]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)
