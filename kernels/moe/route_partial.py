"""The MoE router folded into the projection before it: references of the one-token decode path
that has no router launch of its own.

A MoE layer's router reads ``normed = rms_norm(s)`` of the residual sum ``s = residual + y``, where
``y`` is the mixer's output projection (GDN ``out_proj``, attention ``o_proj``). The norm's scale is
one scalar, so the router is linear in ``s`` up to it::

    logits[e] = Σ_r W[e, r] · s[r] · rstd(s) · (1 + w[r])  =  rstd(s) · u[e],
    u[e]      = Σ_r W[e, r] · s[r] · (1 + w[r])

and ``u`` is a sum over the rows of ``s``: each program of the output projection adds the terms of
the rows it produced (``add_route_partial``), and the experts' kernel, which computes ``rstd(s)``
and ``normed`` from ``s`` itself, scales the sum (``fused_moe_route_partial``). The batch-1 decode
step so loses one dependent launch per MoE layer (the router GEMV with its add + norm prologue).

**The accumulator** ``acc`` ``[ROUTE_COPIES, E + 1]`` int64 holds ``u`` in fixed point (``u · 2^32``,
each program's fp32 partial truncated toward zero): integer sums do not depend on the order the
programs add in, so the logits are the same bits in every run, graph or eager (fp32 atomics would
not be). Programs add into row ``program % ROUTE_COPIES``, so fewer of them contend for one
address; the reader sums the rows. The experts' op **zeroes** ``acc`` after reading it (the
Triton down stage, after its wait), so the next call of the layer starts from zero; a layer owns
its accumulator (``engine.models._moe.SparseMoe``). Range: ``|u| < 2^31`` (a residual stream of
norm ~1e6 at the 35B-A3B shape), resolution ``2^-32``.

**Numerics against the unfused router.** The experts read the same ``normed`` bits (the same
formula, ``kernels.norm.reference.rms_norm``). The logits are not the router's bits: the router multiplies
``normed`` rounded to the model dtype, this path the unrounded ``s · rstd · (1 + w)``, one
rounding less (~1e-3 in a bf16 logit of ~1). Where two logits of the top-k boundary are that
close the routing can differ from the unfused path's; in fp32 they agree to fp32 rounding.
"""

from __future__ import annotations

import torch

from phloem.kernels.linear.fp8 import Fp8Weight
from phloem.kernels.moe.reference import fused_moe_routed

__all__ = [
    "ROUTE_COPIES",
    "ROUTE_SCALE",
    "acc_fits",
    "add_route_partial",
    "fused_moe_route_partial",
    "new_route_acc",
    "route_logits",
]


# Rows of the accumulator, a power of two (the experts' kernel reads the rows as one tile): more
# rows, fewer programs adding into one address, more sums for each of the experts' programs to
# hold in registers; 4 balanced the two (``docs/decisions.md``).
ROUTE_COPIES = 4
ROUTE_SCALE = 2.0**32


def new_route_acc(num_cols: int, device: torch.device) -> torch.Tensor:
    """A zeroed accumulator for ``num_cols`` (= E + 1) logits."""
    return torch.zeros((ROUTE_COPIES, num_cols), dtype=torch.int64, device=device)


def acc_fits(acc: torch.Tensor, num_cols: int) -> bool:
    """``acc`` is an accumulator of this format for ``num_cols`` logits, as the kernels read it:
    ``ROUTE_COPIES`` contiguous int64 rows of ``num_cols`` columns."""
    return (
        acc.dim() == 2 and acc.shape[0] == ROUTE_COPIES and acc.shape[1] == num_cols
        and acc.dtype == torch.int64 and acc.is_contiguous()
    )  # fmt: skip


def add_route_partial(
    y: torch.Tensor, residual: torch.Tensor, router_t: torch.Tensor, norm_w: torch.Tensor, acc: torch.Tensor
) -> torch.Tensor:
    """``s = y + residual`` (rounded to ``y.dtype``, as ``kernels.norm.reference.add_rms_norm``) for one row
    ``[1, H]``; adds ``u = (s · (1 + norm_w)) @ router_t`` (fp32, ``router_t`` ``[H, E + 1]``: the
    router transposed) into ``acc`` in fixed point. Returns ``s``."""
    s = y + residual
    cols = router_t.shape[1]
    u = (s.float() * (1.0 + norm_w.float())) @ router_t.float()
    acc[0] += (u[0] * ROUTE_SCALE).to(torch.int64)
    return s


def route_logits(acc: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, E + 1]`` logits in ``dtype`` from the accumulator and ``rstd(s)`` ``[1, 1]``."""
    u = acc.sum(0, keepdim=True).to(torch.float32) * (1.0 / ROUTE_SCALE)
    return (u * rstd).to(dtype)


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
    """The MoE block of one row from the residual sum ``s`` ``[1, H]`` and the accumulator: the
    layer's norm (``norm_w``, ``eps``), the logits ``rstd(s) · u``, routing and experts as
    ``kernels.moe.reference.fused_moe_routed`` (dense or ``Fp8Weight`` experts). Zeroes ``acc``."""
    rstd = torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)  # kernels.norm.reference's formula
    normed = (s.float() * rstd * (1.0 + norm_w.float())).to(s.dtype)
    logits = route_logits(acc, rstd, s.dtype)
    acc.zero_()
    return fused_moe_routed(normed, logits, w_gate_up, w_down, top_k, renormalize)
