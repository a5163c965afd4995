"""Top-k routing and the SwiGLU mixture-of-experts, matching HF ``Qwen3NextTopKRouter`` / ``Qwen3NextExperts``.

Shapes: ``router_logits`` ``[T, E]``; ``x`` ``[T, H]``; ``w_gate_up`` ``[E, 2I, H]`` (gate rows ``0..I-1``,
then up rows); ``w_down`` ``[E, H, I]``; ``topk_weights`` ``[T, k]`` in the router dtype and ``topk_ids``
``[T, k]`` int64. Expert ``e`` computes ``w_down[e] @ (silu(gate) * up)``; each token sums its ``k`` experts'
outputs scaled by their weights.

Block-FP8 experts: every op takes ``w_gate_up`` / ``w_down`` as a dense tensor or as a
``kernels.linear.fp8.Fp8Weight`` (``data`` ``float8_e4m3fn`` ``[E, N, K]``, ``scale_inv`` fp32
``[E, N, ceil(K / 128)]``, one scale per row and 128-column block, as the model stores them); only
the experts the batch selected are dequantized, each to the weight's model dtype (the values
``Fp8Weight.dense()`` gives, expert by expert). ``fused_moe_fp8`` takes a checkpoint's own
``[E, ceil(rows / bn), ceil(cols / bk)]`` tile scales (``kernels.linear.fp8``'s block format).

Accumulation mirrors HF: experts are visited in ascending id order and their weighted outputs are
``index_add_``-ed into an ``x.dtype`` buffer, so in bf16 each addition rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_dequant

__all__ = ["expert_weight", "fused_moe", "fused_moe_fp8", "fused_moe_routed", "moe_route", "moe_route_shared"]


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) then top-k; returns ``(topk_weights [T, k] in logits dtype, topk_ids [T, k] int64)``."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


def moe_route_shared(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing with the shared expert folded in as expert ``E``.

    ``router_logits`` ``[T, E + 1]``: the router's ``E`` logits, then the shared-expert gate logit.
    Returns ``[T, k + 1]`` weights and ids: the routed top-k as ``moe_route``, then
    ``(sigmoid(gate logit), E)``, so one ``fused_moe`` call computes
    ``Σ routed + sigmoid(gate) * shared_expert(x)`` (HF's ``Qwen3NextSparseMoeBlock``).
    """
    num_experts = router_logits.shape[-1] - 1
    weights, ids = moe_route(router_logits[:, :num_experts], top_k, renormalize)
    shared_w = torch.sigmoid(router_logits[:, num_experts:])
    shared_id = torch.full_like(ids[:, :1], num_experts)
    return torch.cat((weights, shared_w.to(weights.dtype)), dim=1), torch.cat((ids, shared_id), dim=1)


def expert_weight(w: torch.Tensor | Fp8Weight, expert_id: int) -> torch.Tensor:
    """Expert ``expert_id``'s ``[N, K]`` weight, dense: a row of ``w``, or of an ``Fp8Weight``
    dequantized alone."""
    if isinstance(w, Fp8Weight):
        return Fp8Weight(w.data[expert_id], w.scale_inv[expert_id], w.dtype).dense()
    return w[expert_id]


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert_id in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.where(topk_ids == expert_id)
        gate, up = F.linear(x[token_idx], expert_weight(w_gate_up, expert_id)).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, expert_weight(w_down, expert_id))  # [n, H]
        h = h * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def fused_moe_fp8(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    w_down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """``fused_moe`` on block-FP8 experts, dequantizing (to ``x.dtype``) only the selected ones."""
    out = torch.zeros_like(x)
    for expert_id in torch.unique(topk_ids).tolist():
        token_idx, k_idx = torch.where(topk_ids == expert_id)
        w1 = fp8_block_dequant(w_gate_up[expert_id], gate_up_scale_inv[expert_id], block, x.dtype)
        w2 = fp8_block_dequant(w_down[expert_id], down_scale_inv[expert_id], block, x.dtype)
        gate, up = F.linear(x[token_idx], w1).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2)  # [n, H]
        h = h * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def fused_moe_routed(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate_up: torch.Tensor | Fp8Weight,
    w_down: torch.Tensor | Fp8Weight,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """``fused_moe`` over ``moe_route_shared(router_logits, top_k, renormalize)``: routing and experts
    as one op (the Triton version routes inside the experts' kernel)."""
    weights, ids = moe_route_shared(router_logits, top_k, renormalize)
    return fused_moe(x, w_gate_up, w_down, weights, ids)
