"""Query/key prologue of Qwen3-Next / Qwen3.5 gated attention: split, QK RMSNorm and partial RoPE.

Shapes: ``q_gate`` ``[T, Hq, 2D]`` is the ``q_proj`` output viewed per head (HF
``Qwen3NextAttention``: ``view(T, Hq, 2D)`` then ``chunk(2, -1)``)::

    q_gate[t, h] = | query (D) | gate (D) |

``k`` ``[T, Hk, D]``; ``q_norm_w``, ``k_norm_w`` ``[D]`` zero-centred; ``positions`` ``[T]`` int64;
``inv_freq`` ``[R // 2]`` fp32. Returns ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hk, D]`` (zero-centred RMSNorm
over ``D``, then rotate-half RoPE on the first ``R`` dims) and ``gate`` ``[T, Hq * D]``, all in the
input dtype. This is the composition of ``kernels.norm.reference.rms_norm`` and
``kernels.attention.rope.apply_partial_rope`` that ``kernels.attention.triton_qk_norm_rope`` fuses
into one launch.

``qk_norm_rope_gate_store`` is the attention prologue of a step: the same, then the normalised,
rotated ``k`` and ``v`` written into the paged KV cache at ``slot_mapping``
(``kernels.attention.reference.store_kv``); it returns only ``q`` and ``gate`` (attention reads K and V from
the cache). The Triton version does all of it in one launch instead of five.
"""

from __future__ import annotations

import torch

from phloem.kernels.attention.reference import store_kv
from phloem.kernels.attention.rope import apply_partial_rope
from phloem.kernels.norm.reference import rms_norm

__all__ = ["qk_norm_rope_gate", "qk_norm_rope_gate_store"]


def qk_norm_rope_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, Hq, D], k [T, Hk, D], gate [T, Hq * D])``, see the module docstring."""
    num_tokens, num_q_heads, width = q_gate.shape
    query, gate = q_gate.chunk(2, dim=-1)
    q, k = apply_partial_rope(rms_norm(query, q_norm_w, eps), rms_norm(k, k_norm_w, eps), positions, inv_freq)
    return q, k, gate.reshape(num_tokens, num_q_heads * (width // 2))


def qk_norm_rope_gate_store(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, Hq, D], gate [T, Hq * D])``; ``k`` (normalised, rotated) and ``v`` ``[T, Hk, D]`` go
    to ``kv_cache`` ``[pages, 2, page_size, Hk, D]`` at ``slot_mapping`` ``[T]``."""
    q, k_out, gate = qk_norm_rope_gate(q_gate, k, q_norm_w, k_norm_w, positions, inv_freq, eps)
    store_kv(k_out, v, kv_cache, slot_mapping)
    return q, gate
