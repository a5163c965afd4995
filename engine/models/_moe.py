"""Feed-forward blocks: the dense SwiGLU MLP and the sparse MoE with a gated shared expert.

Gate and up projections are stored fused, gate rows first: ``gate_up_proj`` ``[2I, H]`` for a
dense MLP and ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` for
the experts (the loader fuses per-expert checkpoints).

Under tensor parallelism every FFN (each expert, the shared expert E, the dense MLP) keeps the
rank's slice ``[r*I/N, (r+1)*I/N)`` of its intermediate; the down projection's partial sums are
all-reduced. The router is replicated, so every rank routes alike.

Expert parallelism (``TPGroup.expert_parallel``) splits the routed experts instead: rank ``r``
holds experts ``[r*E/N, (r+1)*E/N)`` whole, rank 0 also the whole shared expert. The rank's
expert tensors have ``E/N + 2`` rows::

    0 .. E/N-1   its routed experts (global id - r*E/N)
    E/N          the shared expert (rank 0); zeros on the other ranks, which never read it
    E/N + 1      zeros: every top-k slot routed to another rank's expert points here

Every rank routes every token alike, remaps the ids, runs the same fused kernel, and the
all-reduce adds the ranks' shares: each (token, expert) pair is computed by exactly one rank
and the zero rows contribute exactly 0. Decision: remapping to a zero expert instead of
skipping slots keeps one kernel for both layouts (Triton decode, grouped prefill, the torch
reference) with no per-slot branch; the cost is that a slot routed elsewhere still runs its
GEMV against zeros (L2-resident after the first read, but FLOPs in prefill). Rank 0 reads one
expert more than the others per token (the shared expert).

A shared expert whose FFN size differs from the routed experts' (Hugging Face's Qwen3.5-MoE and
Qwen3-Next configs allow it) cannot be row ``E`` of the expert tensors. Such a model takes the
unfused path (``SparseMoe.fused_shared`` False): the router has ``E`` rows, the shared expert is a
``SwiGluMlp`` of its own size (intermediate split across the ranks under TP and EP alike) and
``shared_expert_gate`` a separate ``[1, H]`` linear, added after the routed experts as in HF's
``Qwen3_5MoeSparseMoeBlock``. It runs the same kernels for the routed experts and none of the
one-token fused decode paths, which assume the shared expert is expert ``E``. Under EP the expert
tensors then have ``E/N + 1`` rows (the zero row last).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phloem.engine.config import ModelConfig
from phloem.engine.models._fp8 import project, weight_operand
from phloem.engine.models._norm import RMSNorm
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.layers import RowParallelLinear, Shard
from phloem.kernels.dispatch import KernelOps
from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe.route_partial import new_route_acc

__all__ = ["Experts", "SparseMoe", "SwiGluMlp", "fused_moe_w8a8"]


def _ffn_shards(prefix: str, intermediate_size: int, tp: TPGroup) -> dict[str, Shard]:
    """gate/up rows and down_proj columns of one FFN of (local) intermediate size ``I``."""
    start = tp.rank * intermediate_size
    rows = Shard.rows((start, start + intermediate_size))
    return {
        f"{prefix}gate_proj.weight": rows,
        f"{prefix}up_proj.weight": rows,
        f"{prefix}down_proj.weight": Shard.cols(start, start + intermediate_size),
    }


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (-1 for an inference tensor, which keeps none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


class SwiGluMlp(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, ops: KernelOps) -> None:
        super().__init__()
        self.tp = tp
        self.ops = ops
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, hidden_size)

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        return _ffn_shards("", self.intermediate_size, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.ops, self.gate_up_proj, x).chunk(2, dim=-1)
        return project(self.ops, self.down_proj, F.silu(gate) * up)


class Experts(nn.Module):
    """Weights only; the ``fused_moe`` op computes with them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def operands(self) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """``(gate_up_proj, down_proj)`` as the MoE ops take them: block-FP8 ones as ``Fp8Weight``
        (the stored bytes and scales; the ops dequantize only the experts they read), else the tensors."""
        return weight_operand(self, "gate_up_proj"), weight_operand(self, "down_proj")


class SparseMoe(nn.Module):
    """``Σ top-k softmax experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)``, fused.

    The shared expert is stored as expert ``E`` of the expert tensors and the shared-expert gate
    as row ``E`` of the router, so a step runs one router GEMV, one routing op that appends
    ``(sigmoid(gate), E)`` to the top-k, and one ``fused_moe`` over ``k + 1`` experts (the
    gate-sigmoid-mul-add of the shared expert costs nothing extra); a one-token decode step runs
    the routing inside the experts' kernel instead (``forward_decode``), and by default the router
    too, its partial logits added by the projection before the block (``decode_route``,
    ``forward_decode_partial``; ``kernels/moe/route_partial.py``). This needs the shared
    expert's FFN size to equal the experts' (true of every released Qwen3.5 / Qwen3-Next); with
    another size the block runs unfused (``fused_shared`` False; the module docstring).

    With ``KernelOps.fp8_w8a8`` a prefill or batched step (``forward``) runs block-FP8 experts as
    two grouped W8A8 GEMMs (``fused_moe_w8a8``); the one-token path (``forward_decode`` and
    ``forward_decode_partial``) keeps the experts' kernels that read FP8 in registers.
    """

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        self.fused_shared = config.shared_expert_intermediate_size == config.moe_intermediate_size
        self.ops = ops
        self.tp = tp
        self.num_experts = e = config.num_experts
        self.top_k = config.num_experts_per_tok
        # Qwen3.5-MoE's router always renormalises the top-k weights; Qwen3-Next reads the flag.
        self.renormalize = config.norm_topk_prob or config.architecture == "Qwen3_5MoeForCausalLM"
        self.router = nn.Linear(config.hidden_size, e + int(self.fused_shared), bias=False)
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        shared = int(self.fused_shared)  # expert rows the shared expert takes
        if self.expert_parallel:
            self.num_local = e // tp.size
            self.first_expert = tp.rank * self.num_local
            self.shared_row, self.zero_row = self.num_local, self.num_local + shared
            self.intermediate_size = config.moe_intermediate_size
        else:
            self.num_local, self.first_expert, self.shared_row, self.zero_row = e, 0, e, -1
            self.intermediate_size = config.moe_intermediate_size // tp.size
        rows = self.num_local + shared + int(self.expert_parallel)
        self.experts = Experts(rows, config.hidden_size, self.intermediate_size)
        if not self.fused_shared:
            self.shared_expert = SwiGluMlp(config.hidden_size, config.shared_expert_intermediate_size, tp, ops)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # The one-token path's transposed router, the router weight's version it was copied at, and
        # the partial-logits accumulator (decode_route); not state: built at the first decode.
        self._route: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def local_expert(self, expert: int) -> int | None:
        """The row of global routed expert ``expert`` in this rank's tensors; None: another rank's."""
        row = expert - self.first_expert
        return row if 0 <= row < self.num_local else None

    def unloaded_rows(self) -> tuple[int, ...]:
        """Expert rows no checkpoint tensor fills on this rank (kept at zero by ``zero_unloaded``)."""
        if not self.expert_parallel:
            return ()
        if self.tp.rank == 0 or not self.fused_shared:
            return (self.zero_row,)
        return (self.shared_row, self.zero_row)

    @torch.no_grad()
    def zero_unloaded(self) -> None:
        for row in self.unloaded_rows():
            self.experts.gate_up_proj[row].zero_()
            self.experts.down_proj[row].zero_()

    def fused_weights(self) -> dict[str, tuple[str, int | None, tuple[int, int] | None]]:
        """Checkpoint tensor -> (parameter, expert row, rows of that parameter) it fills."""
        e = self.num_experts
        if not self.fused_shared:
            return {"gate.weight": ("router.weight", None, None)}
        return {
            "gate.weight": ("router.weight", None, (0, e)),
            "shared_expert_gate.weight": ("router.weight", None, (e, e + 1)),
            "shared_expert.gate_up_proj.weight": ("experts.gate_up_proj", self.shared_row, None),
            "shared_expert.down_proj.weight": ("experts.down_proj", self.shared_row, None),
        }

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor -> the part of it this rank holds (used when ``tp.size > 1``)."""
        if self.expert_parallel:
            return self._expert_parallel_shards()
        inter, start = self.intermediate_size, self.tp.rank * self.intermediate_size
        full = inter * self.tp.size
        everything = slice(None)
        # An unfused shared expert is a SwiGluMlp, which names its own shards.
        shared = _ffn_shards("shared_expert.", inter, self.tp) if self.fused_shared else {}
        return {
            **_ffn_shards("experts.*.", inter, self.tp),
            **shared,
            # Fused [E, 2I, H] / [E, H, I] checkpoint tensors: this rank's gate and up rows.
            "experts.gate_up_proj": Shard(
                ((everything, slice(start, start + inter)), (everything, slice(full + start, full + start + inter))),
                dim=1,
            ),
            "experts.down_proj": Shard(((everything, everything, slice(start, start + inter)),), dim=2),
        }

    def _expert_parallel_shards(self) -> dict[str, Shard]:
        """Whole experts: this rank's rows of fused ``[E, ...]`` tensors; other ranks' per-expert
        tensors (and, except on rank 0, the shared expert's) are not read at all."""
        first, n = self.first_expert, self.num_local
        out = {
            f"experts.{e}.{proj}.weight": Shard.skip()
            for e in range(self.num_experts)
            if self.local_expert(e) is None
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        if self.tp.rank != 0 and self.fused_shared:
            out.update({f"shared_expert.{proj}.weight": Shard.skip() for proj in ("gate_proj", "up_proj", "down_proj")})
        out["experts.gate_up_proj"] = out["experts.down_proj"] = Shard.rows((first, first + n))
        return out

    def forward_decode(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: ``norm`` (the layer's post-attention norm) runs inside the router's GEMV
        (``kernels.linear.reference.add_rms_norm_router``), the routing inside the experts' kernel
        (``fused_moe_routed``); under TP ``hidden`` (a partial sum) is all-reduced in front of the
        router (``RMSNorm.reduce``). Returns ``(out, residual)``. An unfused block (``fused_shared``
        False) and expert parallelism (whose routed ids are remapped to the rank's rows between
        routing and the experts) run the norm, then ``forward``.

        Only here: with more tokens, every program of the Triton gate/up stage routing its own
        token costs more than the routing launch it saves."""
        if not self.fused_shared or self.expert_parallel:
            normed, residual = norm.forward_residual(hidden, residual)
            return self._forward(normed, w8a8=False), residual
        hidden, reduced = norm.reduce(hidden, residual)
        logits, normed, residual = self.ops.add_rms_norm_router(hidden, reduced, norm.weight, norm.eps, self.router.weight)
        out: torch.Tensor = self.ops.fused_moe_routed(
            normed, logits, *self.experts.operands(), self.top_k, self.renormalize
        )
        return out, residual

    def decode_route(self, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(router transposed [H, E + 1], norm weight, accumulator)`` for the one-token path without
        a router launch (``kernels/moe/route_partial.py``; ``KernelOps.route_partial``), else None.

        The transposed copy (1 MB a layer at the 35B-A3B shape) is made at the first call and again
        whenever the router weight has changed in place since (its version counter); a CUDA graph
        captured before such a change keeps reading the old copy, as it keeps any weight's storage.
        The accumulator is zero between calls: ``forward_decode_partial`` zeroes it after reading.

        None under tensor parallelism: the projection before the block produces a rank's partial
        sum, and the router needs the whole residual sum (the ranks' partial logits would need an
        all-reduce of their own); the router then runs after the all-reduce (``forward_decode``)."""
        if not self.ops.route_partial or not self.fused_shared or self.tp.size > 1:
            return None
        w = self.router.weight
        version = _version(w)
        cached = self._route
        if cached is None or cached[0].device != w.device or cached[0].dtype != w.dtype or cached[1] != version:
            acc = cached[2] if cached is not None and cached[2].device == w.device else new_route_acc(w.shape[0], w.device)
            cached = self._route = (w.detach().t().contiguous(), version, acc)
        return cached[0], norm.weight, cached[2]

    def forward_decode_partial(
        self, s: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor, torch.Tensor], norm: RMSNorm
    ) -> torch.Tensor:
        """One token from the residual sum ``s`` whose router partial logits the projection before
        added into ``route``'s accumulator (``decode_route``): the norm, the logits, the routing and
        the experts in the experts' kernels (``fused_moe_route_partial``)."""
        _, norm_w, acc = route
        out: torch.Tensor = self.ops.fused_moe_route_partial(
            s, acc, norm_w, norm.eps, *self.experts.operands(), self.top_k, self.renormalize
        )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A prefill or batched step; with ``ops.fp8_w8a8`` block-FP8 experts run W8A8 (``fused_moe_w8a8``)."""
        return self._forward(x, w8a8=self.ops.fp8_w8a8)

    def _forward(self, x: torch.Tensor, w8a8: bool) -> torch.Tensor:
        route = self.ops.moe_route_shared if self.fused_shared else self.ops.moe_route
        weights, ids = route(self.router(x), self.top_k, self.renormalize)  # [T, k + 1] fused, else [T, k]
        if self.expert_parallel:
            routed = ids[:, : self.top_k] - self.first_expert
            held = (routed >= 0) & (routed < self.num_local)
            ids = torch.cat((routed.where(held, self.zero_row), torch.full_like(ids[:, self.top_k :], self.shared_row)), 1)
        gate_up, down = self.experts.operands()
        out: torch.Tensor
        if w8a8 and isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight):
            out = fused_moe_w8a8(self.ops, x, gate_up, down, weights, ids)
        else:
            out = self.ops.fused_moe(x, gate_up, down, weights, ids)
        if not self.fused_shared:
            gate = project(self.ops, self.shared_expert_gate, x)
            out = out + torch.sigmoid(gate) * self.shared_expert(x)
        return out  # this rank's partial sum: the next norm reduces it (engine.parallel)


def fused_moe_w8a8(
    ops: KernelOps, x: torch.Tensor, w_gate_up: Fp8Weight, w_down: Fp8Weight, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``ops.fused_moe`` with both projections W8A8 (``ops.fp8_w8a8_grouped_linear``, over the
    ``T * k`` ``(token, slot)`` pairs): gate/up reads each token's row of ``x`` ``[T, H]`` for its
    ``k`` pairs, down each pair's SwiGLU row; each token's ``k`` outputs are summed with their
    routing weights in fp32 and rounded once to ``x.dtype``."""
    gate, up = ops.fp8_w8a8_grouped_linear(x, w_gate_up, topk_ids).chunk(2, dim=-1)  # [T * k, I] each
    h = ops.fp8_w8a8_grouped_linear(F.silu(gate) * up, w_down, topk_ids)  # [T * k, H]
    out = (h.view(*topk_ids.shape, -1).float() * topk_weights[..., None].float()).sum(dim=1)
    return out.to(x.dtype)
