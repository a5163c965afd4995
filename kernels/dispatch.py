"""One table of the ops the model calls, bound to Triton kernels or to the torch references.

``get_ops(device, config)`` returns a frozen ``KernelOps``; the model calls ``ops.<name>`` and never
imports an implementation. Every field has the signature and semantics of a torch reference
(``kernels/<op>/reference.py`` and the torch modules beside it); ops without a Triton kernel yet
are the reference in both backends. ``config`` (``kernels.config.KernelConfig``) carries the
choices: the backend (``auto``: Triton on a CUDA device when ``triton`` imports, else torch;
forcing Triton on a non-CUDA device needs ``TRITON_INTERPRET=1``, tests only), the one-token
Triton GEMV, the fused decode path and programmatic dependent launch, which is bound into the
Triton ops here (``kernels/common/pdl.py``).

NOTE: the Triton modules are imported only when selected: ``@triton.jit`` binds to the
interpreter or the compiler at import time, so importing them early would pin that choice.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from phloem.kernels.attention import qk_norm_rope
from phloem.kernels.attention import reference as attention
from phloem.kernels.config import KernelConfig
from phloem.kernels.gdn import conv1d
from phloem.kernels.gdn import reference as gdn
from phloem.kernels.linear import reference as linear
from phloem.kernels.linear import w8a8
from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe import reference as moe
from phloem.kernels.moe import route_partial
from phloem.kernels.moe import w8a8 as moe_w8a8
from phloem.kernels.norm import reference as norm
from phloem.kernels.sampling import reference as sampling

__all__ = ["KernelOps", "get_ops", "kernel_backend"]

Backend = Literal["torch", "triton"]
Op = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The model's ops for one backend; ``backend`` names the choice made.

    ``fused_decode``: a one-token decode step calls the fused projections (``add_rms_norm_linear``
    and the rest of ``kernels.linear.reference``) instead of the ops they compose. On the torch backend
    they are exactly those compositions, so the choice changes launches, not values (but for
    ``route_partial``'s logits); ``KernelConfig.fused_decode``, in both backends.

    ``route_partial``: on that path a MoE layer has no router launch: the output projection before
    it adds the router's partial logits (``gated_rms_norm_linear_route``, ``sigmoid_gate_linear_route``)
    and the experts' op scales them (``fused_moe_route_partial``; ``kernels/moe/route_partial.py``, whose
    logits differ from the router's by one rounding). On with ``fused_decode``; a table with it
    off (``dataclasses.replace``) runs the router as a launch of its own (``add_rms_norm_router``).

    ``pdl``: the Triton ops launch under programmatic dependent launch (always off for torch).

    The dense-projection ops (``linear`` and the fused projections of ``kernels.linear.reference``)
    take their weight as a tensor or as a block-FP8 ``kernels.linear.fp8.Fp8Weight``: the references
    dequantize it, the Triton GEMV reads its FP8 bytes and scales.

    ``fp8_w8a8``: a prefill or batched step's projection whose weight is block FP8 runs
    ``fp8_w8a8_linear`` (activations quantized per token and 128-column group, the tensor-core FP8
    GEMM; ``kernels/linear/w8a8.py``) instead of a matmul on the dequantized weight, and a MoE
    layer's block-FP8 experts run ``fp8_w8a8_grouped_linear`` (the same per expert over the
    ``(token, slot)`` pairs; ``kernels/moe/w8a8.py``) for both projections instead of ``fused_moe``;
    ``KernelConfig.fp8_w8a8``, in both backends (``engine.models._fp8.project``, ``engine.models._moe``).

    The experts' ops (``fused_moe``, ``fused_moe_routed``, ``fused_moe_route_partial``) take their
    weights dense or as ``kernels.linear.fp8.Fp8Weight``; the Triton ones read FP8 in the kernels.
    """

    backend: Backend
    fused_decode: bool
    route_partial: bool
    pdl: bool
    fp8_w8a8: bool
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
    fp8_w8a8_linear: Op
    fp8_w8a8_grouped_linear: Op
    add_rms_norm_linear: Op
    add_rms_norm_conv_linear: Op
    gated_rms_norm_linear: Op
    sigmoid_gate_linear: Op
    add_rms_norm_router: Op
    gated_rms_norm_linear_route: Op
    sigmoid_gate_linear_route: Op
    fused_moe_route_partial: Op
    argmax: Op


def kernel_backend(device: torch.device, config: KernelConfig = KernelConfig()) -> Backend:
    """The backend for ``device``: ``config.backend`` if not ``auto``, else Triton on CUDA when it imports.

    Raises:
        ValueError: Triton is forced on a non-CUDA device without ``TRITON_INTERPRET=1``.
        ImportError: Triton is forced and does not import.
    """
    if config.backend == "torch":
        return "torch"
    if config.backend == "triton":
        import triton

        if device.type != "cuda" and not triton.knobs.runtime.interpret:
            raise ValueError(f"kernel backend 'triton' on device {device} needs CUDA or TRITON_INTERPRET=1")
        return "triton"
    if device.type != "cuda":
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "triton"


def get_ops(device: torch.device, config: KernelConfig = KernelConfig()) -> KernelOps:
    """The op table for ``device`` under ``config`` (see ``kernel_backend`` for the backend and what
    it raises)."""
    reference = KernelOps(
        backend="torch",
        fused_decode=config.fused_decode,
        route_partial=config.fused_decode,
        pdl=False,
        fp8_w8a8=config.fp8_w8a8,
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
        fp8_w8a8_linear=w8a8.fp8_w8a8_block_matmul_reference,
        fp8_w8a8_grouped_linear=moe_w8a8.fp8_w8a8_grouped_linear_reference,
        add_rms_norm_linear=linear.add_rms_norm_linear,
        add_rms_norm_conv_linear=linear.add_rms_norm_conv_linear,
        gated_rms_norm_linear=linear.gated_rms_norm_linear,
        sigmoid_gate_linear=linear.sigmoid_gate_linear,
        add_rms_norm_router=linear.add_rms_norm_router,
        gated_rms_norm_linear_route=linear.gated_rms_norm_linear_route,
        sigmoid_gate_linear_route=linear.sigmoid_gate_linear_route,
        fused_moe_route_partial=route_partial.fused_moe_route_partial,
        argmax=sampling.argmax,
    )
    if kernel_backend(device, config) == "torch":
        return reference
    from phloem.kernels.common.pdl import use_pdl

    return _with_triton(reference, config, use_pdl(config.pdl, device))


# Up to this many tokens the grouped GEMV serves the MoE (covering every CUDA-graph decode bucket);
# prefill-sized batches take the grouped GEMM over tokens sorted by expert.
_SMALL_MOE_TOKENS = 256


def _with_triton(reference: KernelOps, config: KernelConfig, pdl: bool) -> KernelOps:
    from phloem.kernels.attention import triton_qk_norm_rope
    from phloem.kernels.gdn import triton_conv1d, triton_conv1d_varlen, triton_gates
    from phloem.kernels.gdn import triton_decode as triton_gdn
    from phloem.kernels.linear import triton_gemv, triton_w8a8
    from phloem.kernels.moe import triton_decode as triton_moe
    from phloem.kernels.moe import triton_grouped, triton_grouped_w8a8, triton_route, triton_token
    from phloem.kernels.norm import triton_norm
    from phloem.kernels.sampling import triton_argmax

    def fused_moe(
        x: torch.Tensor,
        w_gate_up: torch.Tensor | Fp8Weight,
        w_down: torch.Tensor | Fp8Weight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        small = topk_ids.shape[0] <= _SMALL_MOE_TOKENS
        if not small:
            grouped: torch.Tensor = triton_grouped.fused_moe_grouped(x, w_gate_up, w_down, topk_weights, topk_ids)
            return grouped
        out: torch.Tensor = triton_moe.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, pdl)
        return out

    def fused_moe_routed(
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w_gate_up: torch.Tensor | Fp8Weight,
        w_down: torch.Tensor | Fp8Weight,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        if router_logits.shape[0] <= _SMALL_MOE_TOKENS:
            out: torch.Tensor = triton_moe.fused_moe_routed(
                x, router_logits, w_gate_up, w_down, top_k, renormalize, pdl
            )
            return out
        weights, ids = triton_route.moe_route_shared(router_logits, top_k, renormalize, pdl)
        return fused_moe(x, w_gate_up, w_down, weights, ids)

    def fused_moe_route_partial(
        s: torch.Tensor,
        acc: torch.Tensor,
        norm_w: torch.Tensor,
        eps: float,
        w_gate_up: torch.Tensor | Fp8Weight,
        w_down: torch.Tensor | Fp8Weight,
        top_k: int,
        renormalize: bool,
    ) -> torch.Tensor:
        one = (s.shape[0] == 1 and triton_token.covered(s, w_gate_up, w_down, top_k + 1)
               and route_partial.acc_fits(acc, w_gate_up.shape[0]) and norm_w.shape == (s.shape[1],))  # fmt: skip
        if not one:
            return reference.fused_moe_route_partial(s, acc, norm_w, eps, w_gate_up, w_down, top_k, renormalize)
        out: torch.Tensor = triton_moe.fused_moe_token_route_partial(
            s, acc, norm_w, eps, w_gate_up, w_down, top_k, renormalize, pdl=pdl
        )
        return out

    bind = functools.partial(_with_pdl, pdl=pdl)
    return replace(
        reference,
        backend="triton",
        pdl=pdl,
        fused_moe=fused_moe,
        fused_moe_routed=fused_moe_routed,
        fused_moe_route_partial=fused_moe_route_partial,
        chunk_gated_delta_rule=_fla_chunk_or(reference.chunk_gated_delta_rule),
        rms_norm=bind(triton_norm.rms_norm),
        add_rms_norm=bind(triton_norm.add_rms_norm),
        gated_rms_norm=bind(triton_norm.gated_rms_norm),
        qk_norm_rope_gate=bind(triton_qk_norm_rope.qk_norm_rope_gate),
        qk_norm_rope_gate_store=bind(triton_qk_norm_rope.qk_norm_rope_gate_store),
        causal_conv1d_update=bind(triton_conv1d.causal_conv1d_update),
        causal_conv1d_varlen=triton_conv1d_varlen.causal_conv1d_varlen,
        recurrent_gated_delta_rule=bind(triton_gdn.recurrent_gated_delta_rule),
        recurrent_gated_delta_rule_with_gates=bind(triton_gdn.recurrent_gated_delta_rule_with_gates),
        moe_route=bind(triton_route.moe_route),
        moe_route_shared=bind(triton_route.moe_route_shared),
        gdn_gates=triton_gates.gdn_gates,
        linear=bind(triton_gemv.linear) if config.triton_gemv else reference.linear,
        fp8_w8a8_linear=triton_w8a8.fp8_w8a8_linear,
        fp8_w8a8_grouped_linear=triton_grouped_w8a8.fp8_w8a8_grouped_linear,
        add_rms_norm_linear=bind(triton_gemv.add_rms_norm_linear),
        add_rms_norm_conv_linear=bind(triton_gemv.add_rms_norm_conv_linear),
        gated_rms_norm_linear=bind(triton_gemv.gated_rms_norm_linear),
        sigmoid_gate_linear=bind(triton_gemv.sigmoid_gate_linear),
        add_rms_norm_router=bind(triton_gemv.add_rms_norm_router),
        gated_rms_norm_linear_route=bind(triton_gemv.gated_rms_norm_linear_route),
        sigmoid_gate_linear_route=bind(triton_gemv.sigmoid_gate_linear_route),
        argmax=bind(triton_argmax.argmax),
    )


# Keyword arguments of the Triton launchers that are launch choices, not operands: ``pdl`` is bound
# here, ``config`` (tiles for benchmark sweeps) keeps its default.
_LAUNCH_OPTIONS = ("pdl", "config")


def _with_pdl(op: Op, pdl: bool) -> Op:
    """``op`` with its ``pdl`` argument fixed, under the op's own name and module and with the
    signature it has without its launch options (the reference's, which the model calls)."""
    bound = functools.update_wrapper(functools.partial(op, pdl=pdl), op)
    signature = inspect.signature(op)
    bound.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for name, p in signature.parameters.items() if name not in _LAUNCH_OPTIONS]
    )
    return bound


def _fla_chunk_or(fallback: Op) -> Op:
    """fla-core's chunked GDN prefill when it imports (GPU images), else the torch reference."""
    try:
        import fla  # noqa: F401
    except ImportError:
        return fallback
    from phloem.kernels.gdn.fla import chunk_gated_delta_rule

    return chunk_gated_delta_rule
