"""Partial rotary position embedding (rotate-half convention) of Qwen3-Next / Qwen3.5 attention.

Shapes: ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hk, D]``, ``positions`` ``[T]`` int64,
``inv_freq`` ``[R // 2]`` fp32 where ``R = rotary_dim <= D``. The first ``R`` dims of each head are
rotated as two halves ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``; dims ``R..D-1`` pass
through. Text-only Qwen3.5 M-RoPE has equal position ids on its three axes, so it reduces to this.
"""

from __future__ import annotations

import torch

__all__ = ["apply_partial_rope", "rope_inv_freq"]


def rope_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """``[rotary_dim // 2]`` fp32 inverse frequencies ``base ** (-2i / rotary_dim)``."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def apply_partial_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R // 2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, R]
    # cos/sin are rounded to the activation dtype before multiplying, as HF does.
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
