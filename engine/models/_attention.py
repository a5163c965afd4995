"""Gated full attention of Qwen3-Next / Qwen3.5 over the paged KV cache.

Per head: ``q_proj`` yields ``[query (D) | gate (D)]`` (interleaved per head, so a head-range
shard keeps each head's query and gate together), q and k get a zero-centred RMSNorm over
``head_dim``, the first ``rotary_dim`` dims get RoPE, and the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``.

Under tensor parallelism each rank holds ``Hq / N`` q heads and the KV heads they read
(``engine.parallel``); ``o_proj`` is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ForwardBatch
from phloem.engine.models._fp8 import project, weight_operand
from phloem.engine.models._norm import RMSNorm
from phloem.engine.parallel.group import TPGroup, kv_head_start
from phloem.engine.parallel.layers import RowParallelLinear, Shard
from phloem.kernels.dispatch import KernelOps
from phloem.kernels.attention.flashinfer import TritonDecodePlan

__all__ = ["GatedAttention"]


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp.size
        # KV heads are replicated when there are fewer of them than ranks.
        self.num_kv_heads = max(1, config.num_key_value_heads // tp.size)
        self.q_head_start = tp.rank * self.num_heads
        self.kv_head_start = kv_head_start(config.num_attention_heads, config.num_key_value_heads, tp)
        self.scale = self.head_dim**-0.5
        # q_proj | k_proj | v_proj as one GEMM (``fused_weights`` maps the checkpoint's three).
        self.proj_sizes = [self.num_heads * self.head_dim * 2, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        self.qkv_proj = nn.Linear(hidden, sum(self.proj_sizes), bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, hidden, ops.linear)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        q, k, _ = self.proj_sizes
        return {
            "q_proj.weight": ("qkv_proj.weight", None, (0, q)),
            "k_proj.weight": ("qkv_proj.weight", None, (q, q + k)),
            "v_proj.weight": ("qkv_proj.weight", None, (q + k, q + 2 * k)),
        }

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        d = self.head_dim
        q0, kv0 = self.q_head_start, self.kv_head_start
        kv_rows = Shard.rows((kv0 * d, (kv0 + self.num_kv_heads) * d))
        return {
            "q_proj.weight": Shard.rows((q0 * 2 * d, (q0 + self.num_heads) * 2 * d)),
            "k_proj.weight": kv_rows,
            "v_proj.weight": kv_rows,
            "o_proj.weight": Shard.cols(q0 * d, (q0 + self.num_heads) * d),
        }

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[T, H]``, ``kv_cache`` ``[pages, 2, page_size, Hkv, D]`` -> ``[T, H]``."""
        mix = self.prepare(hidden, batch, kv_cache, inv_freq)
        return project(self.ops, self.o_proj, self.attend(mix, batch, kv_cache, inv_freq))

    def prepare(
        self, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """The step's part before the attention, per token: ``qkv_proj``, then (unless the decode
        attention's prologue does it in its own launch) QK-norm, RoPE, the gate split and the KV
        write. Returns ``(query [T, Hq, D], gate [T, Hq * D])``, or with the prologue the raw
        ``(q_gate, key, value)``; ``attend`` takes either."""
        return self._prepare(project(self.ops, self.qkv_proj, hidden), batch, kv_cache, inv_freq)

    def attend(
        self, mix: tuple[torch.Tensor, ...], batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``prepare``'s tensors -> the gated attention output ``[T, Hq * D]`` (``o_proj``'s input):
        the part of the step that reads the requests' KV lengths and pages."""
        out, gate = self._attend(mix, batch, kv_cache, inv_freq)
        return out * torch.sigmoid(gate)

    def forward_decode(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
        kv_cache: torch.Tensor, inv_freq: torch.Tensor,
        route: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One token: ``norm`` (the layer's input norm) runs inside ``qkv_proj``'s GEMV and the output
        gate inside ``o_proj``'s (``kernels.linear.reference``); under TP ``hidden`` comes reduced
        (``RMSNorm.reduce``) and ``out`` is this rank's partial sum. Returns ``(out, residual)``; with
        ``route`` (``SparseMoe.decode_route``) ``o_proj`` also adds the residual and the router's
        partial logits, and both are the residual sum."""
        qkv, residual = self.ops.add_rms_norm_linear(
            hidden, residual, norm.weight, norm.eps, weight_operand(self.qkv_proj, "weight")
        )
        out, gate = self._attend(self._prepare(qkv, batch, kv_cache, inv_freq), batch, kv_cache, inv_freq)
        o_proj = weight_operand(self.o_proj, "weight")
        if route is not None:
            s = self.ops.sigmoid_gate_linear_route(out, gate, o_proj, residual, *route)
            return s, s
        return self.ops.sigmoid_gate_linear(out, gate, o_proj), residual

    def _prepare(
        self, qkv: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        num_tokens = qkv.shape[0]
        q_gate, key, value = torch.split(qkv, self.proj_sizes, dim=-1)
        q_gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        meta = batch.attn_metadata
        if isinstance(meta, TritonDecodePlan) and meta.prologue:
            return q_gate, key, value  # the prologue runs inside the decode attention's split launch
        # QK-RMSNorm + partial RoPE + output-gate split + the KV-cache write, one fused op on GPU.
        query, gate = self.ops.qk_norm_rope_gate_store(
            q_gate, key, value, self.q_norm.weight, self.k_norm.weight, batch.positions, inv_freq, self.eps,
            kv_cache, batch.slot_mapping,
        )
        return query, gate

    def _attend(
        self, mix: tuple[torch.Tensor, ...], batch: ForwardBatch, kv_cache: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``prepare``'s tensors -> attention output and its gate, both ``[T, Hq * D]``."""
        num_tokens = mix[0].shape[0]
        meta = batch.attn_metadata
        if len(mix) == 3:
            # The prologue (``_prepare``) inside the decode attention's split launch (one launch, not two).
            out, gate = meta.run_prologue(
                *mix, self.q_norm.weight, self.k_norm.weight, batch.positions, inv_freq, self.eps,
                kv_cache, batch.slot_mapping,
            )  # fmt: skip
            return out.reshape(num_tokens, self.num_heads * self.head_dim), gate
        query, gate = mix
        if meta is not None:
            out = meta.run(query, kv_cache)  # [T, Hq, D]
        else:
            out = self.ops.paged_attention(
                query, kv_cache, batch.page_table, batch.query_start_loc, batch.seq_lens, self.scale
            )  # [T, Hq, D]
        return out.reshape(num_tokens, self.num_heads * self.head_dim), gate
