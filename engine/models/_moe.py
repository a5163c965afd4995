"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a gated shared expert.

Gate and up projections are stored fused, gate rows first: ``gate_up_proj`` ``[2I, H]`` for a
dense MLP and ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` for
the experts (the loader fuses per-expert checkpoints).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.kernels.dispatch import KernelOps

__all__ = ["Experts", "SparseMoe", "SwiGluMlp"]


class SwiGluMlp(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

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

    def __init__(self, config: ModelConfig, ops: KernelOps, tp_size: int = 1) -> None:
        super().__init__()
        if config.shared_expert_intermediate_size != config.moe_intermediate_size:
            raise ValueError(
                "shared_expert_intermediate_size: expected it to equal moe_intermediate_size="
                f"{config.moe_intermediate_size} (the shared expert runs as expert E), "
                f"got {config.shared_expert_intermediate_size}"
            )
        self.ops = ops
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        # Qwen3.5-MoE's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        self.renormalize = config.norm_topk_prob or config.architecture == "Qwen3_5MoeForCausalLM"
        self.router = nn.Linear(config.hidden_size, config.num_experts + 1, bias=False)
        self.experts = Experts(config.num_experts + 1, config.hidden_size, config.moe_intermediate_size // tp_size)

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        e = self.num_experts
        return {
            "gate.weight": ("router.weight", None, (0, e)),
            "shared_expert_gate.weight": ("router.weight", None, (e, e + 1)),
            "shared_expert.gate_up_proj.weight": ("experts.gate_up_proj", e, None),
            "shared_expert.down_proj.weight": ("experts.down_proj", e, None),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.ops.moe_route_shared(self.router(x), self.top_k, self.renormalize)  # [T, k + 1]
        out: torch.Tensor = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return out
