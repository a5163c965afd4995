"""Gated DeltaNet (linear attention) of Qwen3-Next / Qwen3.5 over the GDN state slots.

Parameters follow Qwen3.5's layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``);
the loader converts Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``. The conv1d runs over
the channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` and its weight is kept as ``[conv_dim, K]``.
Value head ``h`` reads key head ``h // (Hv // Hk)``; the kernels expand Hk -> Hv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ForwardBatch
from phloem.engine.models._norm import GatedRMSNorm
from phloem.kernels.dispatch import KernelOps

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp_size: int = 1) -> None:
        super().__init__()
        self.ops = ops
        hidden = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads // tp_size
        self.num_v_heads = config.linear_num_value_heads // tp_size
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.key_head_dim
        self.value_dim = self.num_v_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, config.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps, ops)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[T, H]``; ``conv_states`` ``[slots, conv_dim, K-1]``,
        ``ssm_states`` ``[slots, Hv, Dk, Dv]`` fp32 -> ``[T, H]``."""
        num_tokens = hidden.shape[0]
        mixed_qkv = self.in_proj_qkv(hidden)  # [T, conv_dim]
        z = self.in_proj_z(hidden).view(num_tokens, self.num_v_heads, self.value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(hidden))  # [T, Hv]
        # fp32: exp(A_log) overflows fp16 and the decay is a log-space quantity.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias.float())
        if batch.is_decode:
            mixed_qkv = self.ops.causal_conv1d_update(
                mixed_qkv, self.conv_weight, None, conv_states, batch.read_slots, batch.write_slots
            )
        else:
            mixed_qkv = self.ops.causal_conv1d_varlen(
                mixed_qkv, self.conv_weight, None, conv_states, batch.query_start_loc,
                batch.read_slots, batch.write_slots, batch.has_initial_state,
            )
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.view(num_tokens, self.num_k_heads, self.key_head_dim)
        key = key.view(num_tokens, self.num_k_heads, self.key_head_dim)
        value = value.view(num_tokens, self.num_v_heads, self.value_head_dim)
        if batch.is_decode:
            out = self.ops.recurrent_gated_delta_rule(
                query, key, value, g, beta, ssm_states, batch.read_slots, batch.write_slots
            )
        else:
            out = self.ops.chunk_gated_delta_rule(
                query, key, value, g, beta, ssm_states, batch.query_start_loc,
                batch.read_slots, batch.write_slots, batch.has_initial_state,
            )  # [T, Hv, Dv]
        out = self.norm(out, z)
        result: torch.Tensor = self.out_proj(out.reshape(num_tokens, self.value_dim))
        return result
