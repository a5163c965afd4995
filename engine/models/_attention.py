"""Gated full attention of Qwen3-Next / Qwen3.5 over the paged KV cache.

Per head: ``q_proj`` yields ``[query (D) | gate (D)]`` (interleaved per head, so a head-range
shard keeps each head's query and gate together), q and k get a zero-centred RMSNorm over
``head_dim``, the first ``rotary_dim`` dims get RoPE, and the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ForwardBatch
from phloem.engine.models._norm import RMSNorm
from phloem.kernels.attention import paged_attention, store_kv
from phloem.kernels.rope import apply_partial_rope

__all__ = ["GatedAttention"]


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int = 1) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        # KV heads are replicated when there are fewer of them than ranks.
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[T, H]``, ``kv_cache`` ``[pages, 2, page_size, Hkv, D]`` -> ``[T, H]``."""
        num_tokens = hidden.shape[0]
        query, gate = self.q_proj(hidden).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)  # [T, Hq, D]
        key = self.k_norm(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim))
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = apply_partial_rope(query, key, batch.positions, inv_freq)
        store_kv(key, value, kv_cache, batch.slot_mapping)
        out = paged_attention(
            query, kv_cache, batch.page_table, batch.query_start_loc, batch.seq_lens, self.scale
        )  # [T, Hq, D]
        out = out * torch.sigmoid(gate)
        result: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return result
