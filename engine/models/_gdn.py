"""Gated DeltaNet (linear attention) of Qwen3-Next / Qwen3.5 over the GDN state slots.

The four input projections of Qwen3.5's layout (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``) are one ``in_proj`` here, rows ``[qkv | z | b | a]``: one GEMV per decode step instead
of four (``fused_weights`` tells the loader where each checkpoint tensor goes; Qwen3-Next's fused,
head-interleaved ``in_proj_qkvz`` / ``in_proj_ba`` are converted first). The conv1d runs over
the channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` and its weight is kept as ``[conv_dim, K]``.
Value head ``h`` reads key head ``h // (Hv // Hk)``; the kernels expand Hk -> Hv.

Under tensor parallelism each rank holds ``Hk / N`` key and ``Hv / N`` value heads (value heads
``[r*Hv/N, (r+1)*Hv/N)`` read exactly key heads ``[r*Hk/N, (r+1)*Hk/N)``), so the local layout
is the same as above with smaller counts; ``out_proj`` is row-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ForwardBatch
from phloem.engine.models._fp8 import project, weight_operand
from phloem.engine.models._norm import GatedRMSNorm, RMSNorm
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.layers import RowParallelLinear, Shard
from phloem.kernels.dispatch import KernelOps

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        hidden = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads // tp.size
        self.num_v_heads = config.linear_num_value_heads // tp.size
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
        self.out_proj = RowParallelLinear(self.value_dim, hidden, ops.linear)

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        names = ["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"]
        bounds = torch.tensor([0, *self.proj_sizes]).cumsum(0).tolist()
        return {n: ("in_proj.weight", None, (bounds[i], bounds[i + 1])) for i, n in enumerate(names)}

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        dk, dv, nk, nv = self.key_head_dim, self.value_head_dim, self.num_k_heads, self.num_v_heads
        k0, v0 = self.tp.rank * nk, self.tp.rank * nv
        key_dim = nk * self.tp.size * dk  # of the whole model
        conv = Shard.rows(
            (k0 * dk, (k0 + nk) * dk),
            (key_dim + k0 * dk, key_dim + (k0 + nk) * dk),
            (2 * key_dim + v0 * dv, 2 * key_dim + (v0 + nv) * dv),
        )
        heads = Shard.rows((v0, v0 + nv))
        # Qwen3-Next's fused tensors are grouped per key head: one contiguous block per rank.
        ratio = nv // nk
        qkvz_rows = 2 * dk + 2 * ratio * dv
        return {
            "in_proj_qkv.weight": conv,
            "conv1d.weight": conv,
            "in_proj_z.weight": Shard.rows((v0 * dv, (v0 + nv) * dv)),
            "in_proj_b.weight": heads,
            "in_proj_a.weight": heads,
            "A_log": heads,
            "dt_bias": heads,
            "in_proj_qkvz.weight": Shard.rows((k0 * qkvz_rows, (k0 + nk) * qkvz_rows)),
            "in_proj_ba.weight": Shard.rows((k0 * 2 * ratio, (k0 + nk) * 2 * ratio)),
            "out_proj.weight": Shard.cols(v0 * dv, (v0 + nv) * dv),
        }

    def forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` ``[T, H]``; ``conv_states`` ``[slots, conv_dim, K-1]``,
        ``ssm_states`` ``[slots, Hv, Dk, Dv]`` fp32 -> ``[T, H]``."""
        proj = project(self.ops, self.in_proj, hidden)
        return self.finish(self.mix(proj, batch, conv_states, ssm_states), proj)

    def mix(
        self, proj: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """``in_proj``'s output ``[T, *]`` -> the delta rule's output ``[T, Hv, Dv]``: the conv and the
        recurrence, the part of the step that reads and writes the requests' state slots."""
        mixed_qkv, _, b, a = torch.split(proj, self.proj_sizes, dim=-1)
        if batch.is_decode:
            mixed_qkv = self.ops.causal_conv1d_update(
                mixed_qkv, self.conv_weight, None, conv_states, batch.read_slots, batch.write_slots
            )
        else:
            mixed_qkv = self.ops.causal_conv1d_varlen(
                mixed_qkv, self.conv_weight, None, conv_states, batch.query_start_loc,
                batch.read_slots, batch.write_slots, batch.has_initial_state,
            )  # fmt: skip
        return self._mix(mixed_qkv, a, b, batch, ssm_states)

    def finish(self, core: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        """``mix``'s output and ``in_proj``'s (for the gate ``z``) -> ``[T, H]``: the gated norm and
        ``out_proj``."""
        z = torch.split(proj, self.proj_sizes, dim=-1)[1]
        out = self.norm(core, self._heads(z))
        result: torch.Tensor = project(self.ops, self.out_proj, out.reshape(core.shape[0], self.value_dim))
        return result

    def forward_decode(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, batch: ForwardBatch,
        conv_states: torch.Tensor, ssm_states: torch.Tensor,
        route: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One decode token: ``norm`` (the layer's input norm) and the conv update run inside
        ``in_proj``'s GEMV, the gated output norm inside ``out_proj``'s (``kernels.linear.reference``);
        under TP ``hidden`` comes reduced (``RMSNorm.reduce``) and ``out`` is this rank's partial sum.
        Returns ``(out, residual)``; with ``route`` (the MoE router's operands,
        ``SparseMoe.decode_route``) ``out_proj`` also adds the residual and the router's partial
        logits, and both are the residual sum."""
        proj, residual = self.ops.add_rms_norm_conv_linear(
            hidden, residual, norm.weight, norm.eps, weight_operand(self.in_proj, "weight"), self.conv_weight, conv_states,
            batch.read_slots, batch.write_slots,
        )
        mixed_qkv, z, b, a = torch.split(proj, self.proj_sizes, dim=-1)
        out = self._mix(mixed_qkv, a, b, batch, ssm_states)
        out_proj = weight_operand(self.out_proj, "weight")
        if route is not None:
            s = self.ops.gated_rms_norm_linear_route(
                out, self._heads(z), self.norm.weight, self.norm.eps, out_proj, residual, *route
            )
            return s, s
        return self.ops.gated_rms_norm_linear(out, self._heads(z), self.norm.weight, self.norm.eps, out_proj), residual

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        return z.view(z.shape[0], self.num_v_heads, self.value_head_dim)

    def _mix(
        self, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch, ssm_states: torch.Tensor
    ) -> torch.Tensor:
        """The conv output ``q|k|v`` and the gate projections -> the delta rule's output ``[T, Hv, Dv]``."""
        num_tokens = mixed_qkv.shape[0]
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.view(num_tokens, self.num_k_heads, self.key_head_dim)
        key = key.view(num_tokens, self.num_k_heads, self.key_head_dim)
        value = value.view(num_tokens, self.num_v_heads, self.value_head_dim)
        if batch.is_decode:
            # The gates are computed inside the decode step's kernel on GPU.
            out: torch.Tensor = self.ops.recurrent_gated_delta_rule_with_gates(
                query, key, value, a, b, self.A_log, self.dt_bias, ssm_states, batch.read_slots, batch.write_slots
            )
            return out
        # g: fp32 log decay (exp(A_log) overflows fp16); beta in the model dtype.
        g, beta = self.ops.gdn_gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
        out = self.ops.chunk_gated_delta_rule(
            query, key, value, g, beta, ssm_states, batch.query_start_loc,
            batch.read_slots, batch.write_slots, batch.has_initial_state, chunks=batch.gdn_chunks,
        )  # [T, Hv, Dv]
        return out
