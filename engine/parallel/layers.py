"""Tensor parallelism's sharded layers and the shard specs the loader reads.

Which rows or columns each rank holds is the table in ``engine.parallel.group``; every module's
``checkpoint_shards()`` says which part of each checkpoint tensor its rank reads (``Shard``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phloem.engine.parallel.group import TPGroup

Op = Callable[..., Any]

__all__ = ["ParallelEmbedding", "ParallelLMHead", "RowParallelLinear", "Shard"]


@dataclass(frozen=True, slots=True)
class Shard:
    """The part of one checkpoint tensor a rank reads: ``parts`` (index tuples) concatenated along
    ``dim``, zero-padded to ``pad_rows`` rows (vocab shards)."""

    parts: tuple[tuple[slice, ...], ...]
    dim: int = 0
    pad_rows: int | None = None

    @classmethod
    def rows(cls, *ranges: tuple[int, int]) -> Shard:
        return cls(tuple((slice(a, b),) for a, b in ranges))

    @classmethod
    def skip(cls) -> Shard:
        """This rank holds none of the tensor: the loader does not read it (expert parallelism)."""
        return cls(())

    @property
    def skipped(self) -> bool:
        return not self.parts

    @classmethod
    def cols(cls, start: int, end: int) -> Shard:
        return cls(((slice(None), slice(start, end)),), dim=1)

    def read(self, tensor_slice: Any) -> torch.Tensor:
        """Read from a ``safe_open(...).get_slice(name)``: only this rank's bytes leave the file."""
        pieces = [tensor_slice[index] for index in self.parts]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)
        if self.pad_rows is not None and out.shape[0] < self.pad_rows:
            pad = out.new_zeros((self.pad_rows - out.shape[0], *out.shape[1:]))
            out = torch.cat((out, pad))
        return out


def _vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """``(first row, rows per rank)``: the vocab padded to a multiple of the group size."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


def _vocab_shard(vocab_size: int, start: int, per_rank: int) -> dict[str, Shard]:
    """The rank's vocab rows of ``weight``; the last rank's padding rows read as zeros."""
    return {"weight": Shard(((slice(start, min(vocab_size, start + per_rank)),),), pad_rows=per_rank)}


class ParallelEmbedding(nn.Module):
    """Vocab-parallel token embedding; ``weight`` holds this rank's (padded) vocab rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, per_rank = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def checkpoint_shards(self) -> dict[str, Shard]:
        return _vocab_shard(self.vocab_size, self.start, self.weight.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the embeddings (zero rows for tokens outside its vocab rows);
        the first layer's input norm reduces it, as for a ``RowParallelLinear``."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill_(outside[:, None], 0.0)


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection; logits come back whole on rank 0 only."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, linear: Op = F.linear) -> None:
        super().__init__()
        self.tp = tp
        self.linear = linear  # the op table's ``linear`` (one-token GEMV on GPU)
        self.vocab_size = vocab_size
        self.start, per_rank = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))

    def checkpoint_shards(self) -> dict[str, Shard]:
        return _vocab_shard(self.vocab_size, self.start, self.weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[S, H]`` -> ``[S, V]`` in the weight dtype (None on ranks other than 0)."""
        logits = self.tp.gather_first(self.linear(hidden, self.weight), dim=-1)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, : self.vocab_size]


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split across ranks; returns this rank's partial sum.

    The sum over the ranks is left to whoever reads the output: in the model that is the next
    ``RMSNorm.forward_residual``, which reduces it in the same kernel as the residual add and norm
    (``TPGroup.all_reduce_add_rms_norm``).
    """

    def __init__(self, in_features: int, out_features: int, linear: Op = F.linear) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.linear = linear  # the op table's ``linear`` where the owner has one (``kernels.dispatch``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x, self.weight)
        return out
