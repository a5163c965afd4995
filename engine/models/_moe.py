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
    """``fused_moe(top-k softmax experts) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config: ModelConfig, ops: KernelOps, tp_size: int = 1) -> None:
        super().__init__()
        self.ops = ops
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        # Qwen3.5-MoE's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        self.renormalize = config.norm_topk_prob or config.architecture == "Qwen3_5MoeForCausalLM"
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size // tp_size)
        self.shared_expert = SwiGluMlp(hidden, config.shared_expert_intermediate_size // tp_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.ops.moe_route(self.gate(x), self.top_k, self.renormalize)
        routed = self.ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, topk_weights, topk_ids)
        shared: torch.Tensor = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared
