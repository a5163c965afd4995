"""One table of the ops the model calls, bound to Triton kernels or to the torch references.

``get_ops(device)`` returns a frozen ``KernelOps``; the model calls ``ops.<name>`` and never imports
an implementation. Every field has the signature and semantics of the reference in ``kernels/``;
ops without a Triton kernel yet are the reference in both backends.

Backend choice, read only here: ``PHLOEM_KERNELS=torch`` or ``triton`` forces one; unset or empty
picks Triton on a CUDA device when ``triton`` imports, else torch. Forcing Triton on a non-CUDA
device needs ``TRITON_INTERPRET=1`` (tests only).

NOTE: the Triton modules are imported only when selected: ``@triton.jit`` binds to the
interpreter or the compiler at import time, so importing them early would pin that choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from phloem.kernels import argmax, attention, conv1d, fused_linear, gdn, linear, moe, norm, qk_norm_rope, route_partial

__all__ = [
    "ENV_VAR",
    "FUSED_DECODE_ENV_VAR",
    "GEMV_ENV_VAR",
    "ROUTE_PARTIAL_ENV_VAR",
    "KernelOps",
    "get_ops",
    "kernel_backend",
]

ENV_VAR = "PHLOEM_KERNELS"
# "0": cuBLAS serves one-token ``linear`` calls too; by default the Triton GEMV does
# (kernels/triton/gemv.py: 5-35% faster than cuBLAS at every 35B-A3B decode shape on an H200).
GEMV_ENV_VAR = "PHLOEM_TRITON_GEMV"
# "0": the model's one-token decode path calls the unfused ops (``KernelOps.fused_decode``).
FUSED_DECODE_ENV_VAR = "PHLOEM_FUSED_DECODE"
# "0": the fused one-token path keeps the MoE router's own launch (``add_rms_norm_router``) instead
# of its partial logits in the output projection before it (``KernelOps.route_partial``).
ROUTE_PARTIAL_ENV_VAR = "PHLOEM_ROUTE_PARTIAL"

Backend = Literal["torch", "triton"]
Op = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The model's ops for one backend; ``backend`` names the choice made.

    ``fused_decode``: a one-token decode step calls the fused projections (``add_rms_norm_linear``
    and the rest of ``kernels.fused_linear``) instead of the ops they compose. On the torch backend
    they are exactly those compositions, so the choice changes launches, not values (but for
    ``route_partial``'s logits); it is on in both backends unless ``PHLOEM_FUSED_DECODE=0``.

    ``route_partial``: on that path a MoE layer has no router launch: the output projection before
    it adds the router's partial logits (``gated_rms_norm_linear_route``, ``sigmoid_gate_linear_route``)
    and the experts' op scales them (``fused_moe_route_partial``; ``kernels/route_partial.py``, whose
    logits differ from the router's by one rounding). On with ``fused_decode`` unless
    ``PHLOEM_ROUTE_PARTIAL=0``.
    """

    backend: Backend
    fused_decode: bool
    route_partial: bool
    rms_norm: Op
    add_rms_norm: Op
    gated_rms_norm: Op
    qk_norm_rope_gate: Op
    qk_norm_rope_gate_store: Op
    causal_conv1d_update: Op
    causal_conv1d_varlen: Op
    recurrent_gated_delta_rule: Op
    recurrent_gated_delta_rule_with_gates: Op
    chunk_gated_delta_rule: Op
    gdn_gates: Op
    store_kv: Op
    paged_attention: Op
    moe_route: Op
    moe_route_shared: Op
    fused_moe: Op
    fused_moe_routed: Op
    linear: Op
    add_rms_norm_linear: Op
    add_rms_norm_conv_linear: Op
    gated_rms_norm_linear: Op
    sigmoid_gate_linear: Op
    add_rms_norm_router: Op
    gated_rms_norm_linear_route: Op
    sigmoid_gate_linear_route: Op
    fused_moe_route_partial: Op
    argmax: Op


def kernel_backend(device: torch.device) -> Backend:
    """The backend for ``device``: ``PHLOEM_KERNELS`` if set, else Triton on CUDA when it imports.

    Raises:
        ValueError: ``PHLOEM_KERNELS`` is not ``torch``, ``triton`` or empty, or Triton is forced on a
            non-CUDA device without ``TRITON_INTERPRET=1``.
        ImportError: Triton is forced and does not import.
    """
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"{ENV_VAR} must be 'torch', 'triton' or unset, got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        import triton

        if device.type != "cuda" and not triton.knobs.runtime.interpret:
            raise ValueError(f"{ENV_VAR}=triton on device {device} needs CUDA or TRITON_INTERPRET=1")
        return "triton"
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def get_ops(device: torch.device) -> KernelOps:
    """The op table for ``device`` (see ``kernel_backend`` for the choice and what it raises)."""
    fused_decode = os.environ.get(FUSED_DECODE_ENV_VAR, "").strip() != "0"
    reference = KernelOps(
        backend="torch",
        fused_decode=fused_decode,
        route_partial=fused_decode and os.environ.get(ROUTE_PARTIAL_ENV_VAR, "").strip() != "0",
        rms_norm=norm.rms_norm,
        add_rms_norm=norm.add_rms_norm,
        gated_rms_norm=norm.gated_rms_norm,
        qk_norm_rope_gate=qk_norm_rope.qk_norm_rope_gate,
        qk_norm_rope_gate_store=qk_norm_rope.qk_norm_rope_gate_store,
        causal_conv1d_update=conv1d.causal_conv1d_update,
        causal_conv1d_varlen=conv1d.causal_conv1d_varlen,
        recurrent_gated_delta_rule=gdn.recurrent_gated_delta_rule,
        recurrent_gated_delta_rule_with_gates=gdn.recurrent_gated_delta_rule_with_gates,
        chunk_gated_delta_rule=gdn.chunk_gated_delta_rule,
        gdn_gates=gdn.gdn_gates,
        store_kv=attention.store_kv,
        paged_attention=attention.paged_attention,
        moe_route=moe.moe_route,
        moe_route_shared=moe.moe_route_shared,
        fused_moe=moe.fused_moe,
        fused_moe_routed=moe.fused_moe_routed,
        linear=linear.linear,
        add_rms_norm_linear=fused_linear.add_rms_norm_linear,
        add_rms_norm_conv_linear=fused_linear.add_rms_norm_conv_linear,
        gated_rms_norm_linear=fused_linear.gated_rms_norm_linear,
        sigmoid_gate_linear=fused_linear.sigmoid_gate_linear,
        add_rms_norm_router=fused_linear.add_rms_norm_router,
        gated_rms_norm_linear_route=fused_linear.gated_rms_norm_linear_route,
        sigmoid_gate_linear_route=fused_linear.sigmoid_gate_linear_route,
        fused_moe_route_partial=route_partial.fused_moe_route_partial,
        argmax=argmax.argmax,
    )
    return reference if kernel_backend(device) == "torch" else _with_triton(reference)


# Up to this many tokens the grouped GEMV serves the MoE (covering every CUDA-graph decode bucket);
# prefill-sized batches take the grouped GEMM over tokens sorted by expert.
_SMALL_MOE_TOKENS = 256


def _with_triton(reference: KernelOps) -> KernelOps:
    from phloem.kernels.triton import argmax as triton_argmax
    from phloem.kernels.triton import conv1d_update, gdn_decode, gdn_gates, gemv, moe_grouped, moe_route, moe_token
    from phloem.kernels.triton import fused_moe as triton_fused_moe
    from phloem.kernels.triton import norm as triton_norm
    from phloem.kernels.triton import qk_norm_rope as triton_qk_norm_rope

    def fused_moe(
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        small = topk_ids.shape[0] <= _SMALL_MOE_TOKENS
        impl = triton_fused_moe.fused_moe if small else moe_grouped.fused_moe_grouped
        out: torch.Tensor = impl(x, w_gate_up, w_down, topk_weights, topk_ids)
        return out

    def fused_moe_routed(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        if router_logits.shape[0] <= _SMALL_MOE_TOKENS:
            out: torch.Tensor = triton_fused_moe.fused_moe_routed(x, router_logits, w_gate_up, w_down, top_k, renormalize)
            return out
        weights, ids = moe_route.moe_route_shared(router_logits, top_k, renormalize)
        return fused_moe(x, w_gate_up, w_down, weights, ids)

    def fused_moe_route_partial(
        s: torch.Tensor,
        acc: torch.Tensor,
        norm_w: torch.Tensor,
        eps: float,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        one = (s.shape[0] == 1 and moe_token.covered(s, w_gate_up, w_down, top_k + 1)
               and route_partial.acc_fits(acc, w_gate_up.shape[0]) and norm_w.shape == (s.shape[1],))  # fmt: skip
        if not one:
            return reference.fused_moe_route_partial(s, acc, norm_w, eps, w_gate_up, w_down, top_k, renormalize)
        out: torch.Tensor = triton_fused_moe.fused_moe_token_route_partial(
            s, acc, norm_w, eps, w_gate_up, w_down, top_k, renormalize
        )
        return out

    return replace(
        reference,
        backend="triton",
        fused_moe=fused_moe,
        fused_moe_routed=fused_moe_routed,
        fused_moe_route_partial=fused_moe_route_partial,
        chunk_gated_delta_rule=_fla_chunk_or(reference.chunk_gated_delta_rule),
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        gated_rms_norm=triton_norm.gated_rms_norm,
        qk_norm_rope_gate=triton_qk_norm_rope.qk_norm_rope_gate,
        qk_norm_rope_gate_store=triton_qk_norm_rope.qk_norm_rope_gate_store,
        causal_conv1d_update=conv1d_update.causal_conv1d_update,
        recurrent_gated_delta_rule=gdn_decode.recurrent_gated_delta_rule,
        recurrent_gated_delta_rule_with_gates=gdn_decode.recurrent_gated_delta_rule_with_gates,
        moe_route=moe_route.moe_route,
        moe_route_shared=moe_route.moe_route_shared,
        gdn_gates=gdn_gates.gdn_gates,
        linear=reference.linear if os.environ.get(GEMV_ENV_VAR, "").strip() == "0" else gemv.linear,
        add_rms_norm_linear=gemv.add_rms_norm_linear,
        add_rms_norm_conv_linear=gemv.add_rms_norm_conv_linear,
        gated_rms_norm_linear=gemv.gated_rms_norm_linear,
        sigmoid_gate_linear=gemv.sigmoid_gate_linear,
        add_rms_norm_router=gemv.add_rms_norm_router,
        gated_rms_norm_linear_route=gemv.gated_rms_norm_linear_route,
        sigmoid_gate_linear_route=gemv.sigmoid_gate_linear_route,
        argmax=triton_argmax.argmax,
    )


def _fla_chunk_or(fallback: Op) -> Op:
    """fla-core's chunked GDN prefill when it imports (GPU images), else the torch reference."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return fallback
    from phloem.kernels.fla_gdn import chunk_gated_delta_rule

    return chunk_gated_delta_rule
