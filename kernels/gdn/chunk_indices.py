"""The chunk indices of varlen GDN sequences, built on the device for a layout of fixed shape.

fla's chunked kernels run one program per (chunk of ``chunk_size`` tokens of a sequence, head):
``chunk_indices[j] = (sequence, chunk within it)`` in sequence order, and the state kernel writes
chunk ``j``'s state at ``chunk_offsets[sequence] + chunk``, which the output kernel reads back at
``j``. fla builds both from ``cu_seqlens`` on the host (a device sync and a grid that depends on
the lengths), so its calls cannot be replayed from a CUDA graph. Here the grid is fixed at
``max_chunks`` entries and both tensors are computed by device ops from ``cu_seqlens`` alone:

    j <  total chunks   (sequence n, chunk j - offsets[n])     as fla's, entry for entry
    j >= total chunks   (last sequence, 0)                     the last sequence must be empty:
                                                               those programs load and store nothing

So a layout of ``B`` sequences (empty ones allowed anywhere: they own no chunk) whose last is
empty, with ``max_chunks >= sum(ceil(len_i / chunk_size))``, gives fla's results bit for bit from
a grid of fixed size: ``sum(ceil(len_i / c)) <= T / c + (non-empty sequences)`` bounds it for ``T``
tokens (``engine.prefill_graph``).
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK_SIZE", "max_chunks", "static_chunk_indices"]

CHUNK_SIZE = 64  # fla's chunk size for the gated delta rule (``kernels.gdn.fla``)


def max_chunks(num_tokens: int, num_seqs: int, chunk_size: int = CHUNK_SIZE) -> int:
    """An upper bound on the chunks of ``num_seqs`` sequences of ``num_tokens`` tokens in all."""
    return -(-num_tokens // chunk_size) + num_seqs


def static_chunk_indices(
    cu_seqlens: torch.Tensor,  # [B + 1] int64, the last sequence empty
    num_chunks: int,
    chunk_size: int = CHUNK_SIZE,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([num_chunks, 2], [B + 1]) int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_indices [num_chunks, 2], chunk_offsets [B + 1])``, int64, without a host read:
    written into ``out`` when given (static buffers a graph reads)."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    offsets = torch.nn.functional.pad(torch.cumsum(torch.div(lens + chunk_size - 1, chunk_size,
                                                             rounding_mode="floor"), 0), (1, 0))  # fmt: skip
    j = torch.arange(num_chunks, device=cu_seqlens.device, dtype=offsets.dtype)
    last = lens.shape[0] - 1
    seq = (torch.searchsorted(offsets, j, right=True) - 1).clamp_(max=last)
    valid = j < offsets[-1]
    seq = torch.where(valid, seq, last)
    chunk = torch.where(valid, j - offsets[seq], 0)
    indices = torch.stack([seq, chunk], 1)
    if out is None:
        return indices, offsets
    out[0].copy_(indices)
    out[1].copy_(offsets)
    return out
