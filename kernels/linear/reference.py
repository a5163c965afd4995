"""Dense projections, alone and fused with the elementwise ops around them: torch references.

``linear`` is ``x @ weight.T`` (``[..., K]`` x ``[N, K]`` -> ``[..., N]``), i.e.
``torch.nn.functional.linear``.

At batch 1 a decode step is hundreds of launches whose bytes are tiny next to the GEMVs between
them, so the ops that only read or write one row of the hidden state go into the projection that
consumes or produces it (``kernels.linear.triton_gemv`` runs each, and ``linear`` for one token,
as one launch)::

    add_rms_norm_linear       add_rms_norm -> linear                       attention qkv_proj
    add_rms_norm_conv_linear  add_rms_norm -> linear -> conv1d update      GDN in_proj (+ conv)
    gated_rms_norm_linear     gated_rms_norm -> linear                     GDN out_proj
    sigmoid_gate_linear       x * sigmoid(gate) -> linear                  attention o_proj
    add_rms_norm_router       add_rms_norm -> router linear                MoE router (the routing
                                                                           runs in the experts'
                                                                           kernel: moe.fused_moe_routed)
    gated_rms_norm_linear_route   gated_rms_norm_linear -> + residual,     GDN out_proj, MoE router
                                  router partial (route_partial)           in it (no router launch)
    sigmoid_gate_linear_route     sigmoid_gate_linear -> + residual,       attention o_proj, the same
                                  router partial

Each fused function is exactly the composition of the references of ``kernels.norm.reference``,
``linear`` and ``kernels.gdn.conv1d`` it names, so a model calling them on the torch backend
computes what the unfused calls compute. Shapes: ``x``, ``residual`` ``[T, K]``; ``weight``
``[N, K]``; outputs ``[T, N]``. Every projection weight may be an ``Fp8Weight`` (``kernels.linear.fp8``:
``float8_e4m3fn`` ``[N, K]`` and fp32 scales ``[N, ceil(K / 128)]``): ``linear`` dequantizes it to
its ``dtype`` (``fp8.dense``) and runs the dense op, exactly the values of a dequantize-on-read
weight (``engine.models._fp8``).

Block FP8 weights (Qwen's FP8 releases, DeepSeek-V3's format): ``w_fp8`` ``[..., N, K]``
``float8_e4m3fn`` and ``scale_inv`` ``[..., ceil(N / bn), ceil(K / bk)]`` fp32, one per
``block = (bn, bk)`` tile (``(128, 128)`` as published; edge tiles are partial); the weight is
``w_fp8 * scale_inv`` broadcast over each tile. ``fp8_block_matmul_reference`` dequantizes to
``x.dtype`` and runs ``linear``: the torch reference of an FP8 GEMV/GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phloem.kernels.gdn.conv1d import causal_conv1d_update
from phloem.kernels.linear.fp8 import FP8_E4M3_MAX, Fp8Weight, dense, fp8_block_dequant, fp8_block_quantize
from phloem.kernels.moe.route_partial import add_route_partial
from phloem.kernels.norm.reference import add_rms_norm, gated_rms_norm

__all__ = [
    "FP8_E4M3_MAX",
    "add_rms_norm_conv_linear",
    "add_rms_norm_linear",
    "add_rms_norm_router",
    "fp8_block_dequant",
    "fp8_block_matmul_reference",
    "fp8_block_quantize",
    "gated_rms_norm_linear",
    "gated_rms_norm_linear_route",
    "linear",
    "sigmoid_gate_linear",
    "sigmoid_gate_linear_route",
]


Weight = torch.Tensor | Fp8Weight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    return F.linear(x, dense(weight))


def fp8_block_matmul_reference(
    x: torch.Tensor, w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``linear(x, fp8_block_dequant(w_fp8, scale_inv, block, x.dtype))``: ``[..., K]`` -> ``[..., N]``."""
    return F.linear(x, fp8_block_dequant(w_fp8, scale_inv, block, x.dtype))


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, weight: Weight
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)``."""
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    return linear(normed, weight), residual


def add_rms_norm_conv_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    weight: Weight,
    conv_w: torch.Tensor,
    conv_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN's decode input projection: ``add_rms_norm_linear``, then the first ``D = conv_w.shape[0]``
    output columns (the conv channels ``q|k|v``) replaced by their causal conv1d + SiLU update
    (``kernels.gdn.conv1d.causal_conv1d_update``, no bias, state at ``read_slots`` / ``write_slots``)."""
    y, residual = add_rms_norm_linear(x, residual, norm_w, eps, weight)
    conv_dim = conv_w.shape[0]
    conv = causal_conv1d_update(y[:, :conv_dim], conv_w, None, conv_states, read_slots, write_slots)
    return torch.cat((conv, y[:, conv_dim:]), dim=-1), residual


def gated_rms_norm_linear(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: Weight
) -> torch.Tensor:
    """``linear(gated_rms_norm(x, gate))`` with ``x``, ``gate`` ``[T, H, D]`` normalised per head of ``D``;
    the projection reads them as ``[T, H * D]``."""
    normed = gated_rms_norm(x, gate, norm_w, eps)
    return linear(normed.reshape(x.shape[0], -1), weight)


def sigmoid_gate_linear(x: torch.Tensor, gate: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``linear(x * sigmoid(gate))`` in ``x.dtype`` (the attention output gate, then ``o_proj``)."""
    return linear(x * torch.sigmoid(gate), weight)


def add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, router_w: Weight
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router logits, normed, x + residual)``: the MoE block's norm and its router ``[E + 1, K]``
    (the shared-expert gate as the last row); the experts read ``normed``."""
    normed, residual = add_rms_norm(x, residual, norm_w, eps)
    return linear(normed, router_w), normed, residual


def gated_rms_norm_linear_route(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: Weight,
    residual: torch.Tensor, router_t: torch.Tensor, post_norm_w: torch.Tensor, acc: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``gated_rms_norm_linear``, then ``kernels.moe.route_partial.add_route_partial`` (the residual sum ``s``,
    returned, and the MoE router's partial logits added into ``acc``)."""
    y = gated_rms_norm_linear(x, gate, norm_w, eps, weight)
    return add_route_partial(y, residual, router_t, post_norm_w, acc)


def sigmoid_gate_linear_route(
    x: torch.Tensor, gate: torch.Tensor, weight: Weight,
    residual: torch.Tensor, router_t: torch.Tensor, post_norm_w: torch.Tensor, acc: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``sigmoid_gate_linear``, then ``kernels.moe.route_partial.add_route_partial``."""
    return add_route_partial(sigmoid_gate_linear(x, gate, weight), residual, router_t, post_norm_w, acc)
