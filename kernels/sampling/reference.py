"""Greedy token choice: the index of each row's largest logit (``[S, V]`` -> ``[S]`` int64).

The reference is ``torch.argmax(logits, dim=-1)``: the first index of the maximum, a NaN counting
as larger than any number (so the first NaN of a row wins). ``kernels.sampling.triton_argmax`` is the GPU
version the CUDA-graph decode step runs inside its graph, on the logits in the model's dtype
(bf16's argmax is its fp32 upcast's: the upcast is exact and keeps the order).
"""

from __future__ import annotations

import torch

__all__ = ["argmax"]


def argmax(
    logits: torch.Tensor, copy_to: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``copy_to`` ``[S]`` int64: also written with the ids (the CUDA-graph step puts them straight
    into the next step's input-id row, ``engine.cuda_graph``). ``out`` ``[S]`` int64: the ids are
    written there and it is returned (a CUDA graph keeps its ids in a buffer outside its memory
    pool, which another graph of the pool may overwrite)."""
    ids = logits.argmax(dim=-1)
    if out is not None:
        out.copy_(ids)
        ids = out
    if copy_to is not None:
        copy_to.copy_(ids)
    return ids
