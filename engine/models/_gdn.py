"""Gated DeltaNet (linear attention) of Qwen3-Next / Qwen3.5 over the GDN state slots.

The four input projections of Qwen3.5's layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) are one ``in_proj`` here, rows ``[qkv | z | b | a]``: one GEMV per decode step instead
of four (``fused_weights`` tells the loader where each checkpoint tensor goes; Qwen3-Next's fused,
head-interleaved ``in_proj_qkvz`` / ``in_proj_ba`` are converted first). The conv1d runs over
the channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` and its weight is kept as ``[conv_dim, K]``.
Value head ``h`` reads key head ``h // (Hv // Hk)``; the kernels expand Hk -> Hv.
"""

from __future__ import annotations

import torch
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
        self.proj_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = nn.Linear(hidden, sum(self.proj_sizes), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, config.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, config.rms_norm_eps, ops)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        names = ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"]
        bounds = torch.tensor([0, *self.proj_sizes]).cumsum(0).tolist()
        return {n: ("in_proj.weight", None, (bounds[i], bounds[i + 1])) for i, n in enumerate(names)}

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[T, H]``; ``conv_states`` ``[slots, conv_dim, K-1]``,
        ``ssm_states`` ``[slots, Hv, Dk, Dv]`` fp32 -> ``[T, H]``."""
        num_tokens = hidden.shape[0]
        mixed_qkv, z, b, a = torch.split(self.in_proj(hidden), self.proj_sizes, dim=-1)
        z = z.view(num_tokens, self.num_v_heads, self.value_head_dim)
        # g: fp32 log decay (exp(A_log) overflows fp16); beta in the model dtype.
        g, beta = self.ops.gdn_gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
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
