"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a gated shared expert.

Gate and up projections are stored fused, gate rows first: ``gate_up_proj`` ``[2I, H]`` for a
dense MLP and ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` for
the experts (the loader fuses per-expert checkpoints).

Under tensor parallelism every FFN (each expert, the shared expert E, the dense MLP) keeps the
rank's slice ``[r*I/N, (r+1)*I/N)`` of its intermediate; the down projection's partial sums are
all-reduced. The router is replicated, so every rank routes alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.parallel import RowParallelLinear, Shard, TPGroup
from phloem.kernels.dispatch import KernelOps

__all__ = ["Experts", "SparseMoe", "SwiGluMlp"]


def _ffn_shards(prefix: str, intermediate_size: int, tp: TPGroup) -> dict[str, Shard]:
    """gate/up rows and down_proj columns of one FFN of (local) intermediate size ``I``."""
    start = tp.rank * intermediate_size
    rows = Shard.rows((start, start + intermediate_size))
    return {
        f"{prefix}gate_proj.weight": rows,
        f"{prefix}up_proj.weight": rows,
        f"{prefix}down_proj.weight": Shard.cols(start, start + intermediate_size),
    }


class SwiGluMlp(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, hidden_size, tp)

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        return _ffn_shards("", self.intermediate_size, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class Experts(nn.Module):
    """Weights only; the ``fused_moe`` op computes with them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoe(nn.Module):
    """``Σ top-k softmax experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)``, fused.

    The shared expert is stored as expert ``E`` of the expert tensors and the shared-expert gate
    as row ``E`` of the router, so a step runs one router GEMV, one routing op that appends
    ``(sigmoid(gate), E)`` to the top-k, and one ``fused_moe`` over ``k + 1`` experts (the
    gate-sigmoid-mul-add of the shared expert costs nothing extra). This needs the shared
    expert's FFN size to equal the experts' (true of every released Qwen3.5 / Qwen3-Next).
    """

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        if config.shared_expert_intermediate_size != config.moe_intermediate_size:
            raise ValueError(
                "shared_expert_intermediate_size: expected it to equal moe_intermediate_size="
                f"{config.moe_intermediate_size} (the shared expert runs as expert E), "
                f"got {config.shared_expert_intermediate_size}"
            )
        self.ops = ops
        self.tp = tp
        self.num_experts = config.num_experts
        self.intermediate_size = config.moe_intermediate_size // tp.size
        self.top_k = config.num_experts_per_tok
        # Qwen3.5-MoE's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        self.renormalize = config.norm_topk_prob or config.architecture == "Qwen3_5MoeForCausalLM"
        self.router = nn.Linear(config.hidden_size, config.num_experts + 1, bias=False)
        self.experts = Experts(config.num_experts + 1, config.hidden_size, self.intermediate_size)

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        e = self.num_experts
        return {
            "gate.weight": ("router.weight", None, (0, e)),
            "shared_expert_gate.weight": ("router.weight", None, (e, e + 1)),
            "shared_expert.gate_up_proj.weight": ("experts.gate_up_proj", e, None),
            "shared_expert.down_proj.weight": ("experts.down_proj", e, None),
        }

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        inter, start = self.intermediate_size, self.tp.rank * self.intermediate_size
        full = inter * self.tp.size
        everything = slice(None)
        return {
            **_ffn_shards("experts.*.", inter, self.tp),
            **_ffn_shards("shared_expert.", inter, self.tp),
            # Fused [E, 2I, H] / [E, H, I] checkpoint tensors: this rank's gate and up rows.
            "experts.gate_up_proj": Shard(
                ((everything, slice(start, start + inter)), (everything, slice(full + start, full + start + inter))),
                dim=1,
            ),
            "experts.down_proj": Shard(((everything, everything, slice(start, start + inter)),), dim=2),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route_shared(self.router(x), self.top_k, self.renormalize)  # [T, k + 1]
        out: torch.Tensor = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return self.tp.all_reduce(out)
