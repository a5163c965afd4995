"""One-token GEMVs of the decode step, each fused with the row ops around it: Triton versions of
``kernels.linear.reference``'s ``linear`` and fused projections.

``y = W x̂`` for one row ``x`` ``[1, K]`` and ``W`` ``[N, K]`` (unit last stride), with ``x̂`` made from
the inputs by a prologue (``PRO``) and, with ``CONV``, the first rows of ``y`` finished by the GDN
conv update::

    PRO_NONE            x̂ = x                                   linear
    PRO_ADD_RMS_NORM    s = x + residual; x̂ = rms_norm(s)       add_rms_norm_linear / _router / conv
                        (program 0 writes s, and x̂ for the router, whose experts read it)
    PRO_GATED_RMS_NORM  x̂ = gated_rms_norm(x, gate) per head    gated_rms_norm_linear
    PRO_SIGMOID_GATE    x̂ = x * sigmoid(gate)                   sigmoid_gate_linear
    CONV                rows < D: the causal conv1d + SiLU update of y with the state at the read /
                        write slot (stored in place of y); rows >= D: y   add_rms_norm_conv_linear
    ROUTE               s = y + residual stored in place of y; each program adds its rows' terms
                        of the MoE router's partial logits into an accumulator (kernels/
                        moe/route_partial.py)                      gated_rms_norm_linear_route,
                                                                   sigmoid_gate_linear_route

Every program computes the prologue of the whole row (``K`` <= ``MAX_K``, held in registers: a few
KiB read through L2 by each program, instead of a launch of its own), then walks row blocks of
``BLOCK_N`` rows of ``W``, ``program_id, program_id + num_programs, ...``: each block is one
``[BLOCK_N, K]`` tile, multiplied in fp32 and reduced once. With ``PREFETCH`` the next block's tile
is loaded before the current one is reduced, and the first block's weights before
``gdc_wait``: weights are never written by the kernels before, so under programmatic dependent
launch the weight stream starts while those kernels finish (``kernels/common/pdl.py``).

Rounding follows the references: the prologue's values are rounded to the input dtype where the
reference's intermediate tensors are (the residual sum, the normalised row, the gate product),
``y`` once from the fp32 sum; the conv update rounds as ``kernels.gdn.triton_conv1d``. The conv
state of a row is read and written by the one program that owns the row (loads before a CTA
barrier, stores after), so ``read_slot == write_slot`` updates in place. A program walking at most
16 blocks loads the conv operands of all its blocks before ``gdc_wait`` (``CONV_BLOCKS``) and runs
the update after the walk, for all its conv rows at once, so no step of the walk waits on the
epilogue: the walk keeps each block's projection in a ``[CONV_BLOCKS, BLOCK_N]`` register tile and
stores only the rows past the conv channels, so the update reads nothing back and each conv row is
stored once (two stores of a row from two threads with no barrier between would race). A longer
walk loads the operands and runs the update block by block inside it.

With ``ROUTE`` a block's rows of the transposed router ``[N, E + 1]`` are loaded with its weight
tile (the first before ``gdc_wait``, the next with the prefetch), its residual rows with the
prologue's loads; the program's fp32 sum goes into the accumulator once, after its walk, as
fixed-point integers (one atomic add a logit).

Every op takes its weight as a dense ``[N, K]`` tensor or as a block-FP8 ``Fp8Weight``
(``kernels.linear.fp8``: ``data`` ``float8_e4m3fn`` ``[N, K]``, ``scale_inv`` fp32 ``[N, ceil(K / 128)]``,
one scale per row and 128-column block). An FP8 weight is read as its bytes and scales and
dequantized in registers (``FP8``, ``triton_gemv_kernel``): half the weight bytes of bf16, fp32
accumulate as for a dense weight, the activations in the model dtype (``Fp8Weight.dtype``).

The kernel is ``triton_gemv_kernel.gemv_kernel``; its tiles ``triton_gemv_config.gemv_config``.
Anything the kernel does not cover (more than one row, ``K > MAX_K``, mixed dtypes, a weight
without unit last stride) goes to the unfused ops, an FP8 weight dequantized there (``fp8.dense``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from phloem.kernels.common.device import balanced_grid
from phloem.kernels.gdn import triton_conv1d
from phloem.kernels.linear.fp8 import Fp8Weight, dense
from phloem.kernels.linear.triton_gemv_config import MAX_K, GemvConfig, gemv_config
from phloem.kernels.linear.triton_gemv_kernel import gemv_kernel
from phloem.kernels.moe.route_partial import ROUTE_COPIES, ROUTE_SCALE, acc_fits, add_route_partial
from phloem.kernels.norm import triton_norm

__all__ = [
    "GemvConfig",
    "add_rms_norm_conv_linear",
    "add_rms_norm_linear",
    "add_rms_norm_router",
    "gated_rms_norm_linear",
    "gated_rms_norm_linear_route",
    "gemv_config",
    "linear",
    "linear_tuned",
    "sigmoid_gate_linear",
    "sigmoid_gate_linear_route",
]

PRO_NONE, PRO_ADD_RMS_NORM, PRO_GATED_RMS_NORM, PRO_SIGMOID_GATE = 0, 1, 2, 3
# A program preloads the conv operands of its blocks and defers the conv update past its walk up
# to this many blocks (the operands are held in registers through the walk).
_MAX_CONV_BLOCKS = 16


Weight = torch.Tensor | Fp8Weight
# Columns an FP8 scale covers (``Fp8Weight``: one scale per row and 128-column block).
_FP8_COLS = 128


def _covered(x: torch.Tensor, weight: Weight, residual: torch.Tensor | None = None) -> bool:
    """One row the kernel can take (and a residual of its shape, where there is one)."""
    num_k = x.shape[-1]
    w = weight.data if isinstance(weight, Fp8Weight) else weight
    return (
        x.numel() == num_k and w.dim() == 2 and w.shape[1] == num_k and w.stride(1) == 1
        and x.dtype == weight.dtype and num_k <= MAX_K and (residual is None or residual.shape == x.shape)
        and (not isinstance(weight, Fp8Weight) or _scales_fit(weight))
    )  # fmt: skip


def _scales_fit(weight: Fp8Weight) -> bool:
    """An ``[N, K]`` e4m3 weight with fp32 scales ``[N, ceil(K / 128)]`` of unit last stride."""
    num_n, num_k = weight.data.shape
    scale = weight.scale_inv
    return (
        weight.data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        and scale.shape == (num_n, triton.cdiv(num_k, _FP8_COLS)) and scale.stride(1) == 1
    )  # fmt: skip


class _Call(NamedTuple):
    """Prologue / epilogue operands of one launch (``x`` stands in for any it does not use)."""

    a: torch.Tensor | None = None
    nw: torch.Tensor | None = None
    res: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    eps: float = 0.0
    head: int = 1
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # weight, states, read, write
    route: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # residual, router_t, norm w, acc


def _launch(x: torch.Tensor, weight: Weight, y: torch.Tensor, pro: int, call: _Call, pdl: bool,
            config: GemvConfig | None = None) -> None:  # fmt: skip
    num_n, num_k = weight.shape
    fp8 = isinstance(weight, Fp8Weight)
    # A dense weight stands in for the scale pointer its launch never reads.
    w, scale = (weight.data, weight.scale_inv) if isinstance(weight, Fp8Weight) else (weight, weight)
    kp = triton.next_power_of_2(num_k)
    c = config or gemv_config(num_n, num_k, call.conv is not None, call.route is not None)
    blocks = triton.cdiv(num_n, c.block_n)
    grid = balanced_grid(blocks, c.programs_per_sm, x.device)
    walk = triton.cdiv(blocks, grid)  # blocks per program
    conv_blocks = triton.next_power_of_2(walk) if call.conv is not None and walk <= _MAX_CONV_BLOCKS else 0
    conv_w, conv_s, r_slot, w_slot = call.conv if call.conv is not None else (x, x, x, x)
    h, router_t, post_w, acc = call.route if call.route is not None else (x, x, x, x)
    nw = call.nw if call.nw is not None else x
    gemv_kernel[(grid,)](
        x, w, y, num_n, num_k, w.stride(0), scale, scale.stride(0),
        call.a if call.a is not None else x, nw, call.res if call.res is not None else x,
        call.normed if call.normed is not None else x, call.eps,
        conv_w, conv_s, r_slot, w_slot, conv_w.stride(0), conv_s.stride(0), conv_s.stride(1) if conv_s.dim() > 1 else 0,
        conv_w.shape[0] if call.conv is not None else 0,
        h, router_t, post_w, acc, router_t.shape[1] if call.route is not None else 1, ROUTE_SCALE,
        PRO=pro, CONV=call.conv is not None, KP=kp, BLOCK_N=c.block_n, PREFETCH=c.prefetch,
        HAS_A=call.a is not None, WRITE_NORMED=call.normed is not None,
        ROUND_WEIGHTED=torch.promote_types(nw.dtype, x.dtype) == x.dtype, HEAD=call.head,
        KC=conv_w.shape[1] if call.conv is not None else 1,
        BKC=triton.next_power_of_2(conv_w.shape[1]) if call.conv is not None else 1, CONV_BLOCKS=conv_blocks,
        ROUTE=call.route is not None,
        BE=triton.next_power_of_2(router_t.shape[1]) if call.route is not None else 1, COPIES=ROUTE_COPIES,
        FP8=fp8, KS=min(kp, _FP8_COLS) if fp8 else 1,
        num_warps=c.num_warps, num_stages=c.num_stages, PDL=pdl, launch_pdl=pdl,
        **({"maxnreg": c.max_registers} if c.max_registers else {}),
    )  # fmt: skip


def _row(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def linear(x: torch.Tensor, weight: Weight, pdl: bool = False) -> torch.Tensor:
    """``x @ weight.T``; one row through the kernel, anything else through ``F.linear`` (``pdl``:
    launched under programmatic dependent launch, ``kernels/common/pdl.py``)."""
    return linear_tuned(x, weight, None, pdl)


def linear_tuned(x: torch.Tensor, weight: Weight, config: GemvConfig | None, pdl: bool = False) -> torch.Tensor:
    """``linear`` with an explicit launch configuration (benchmark sweeps; None: ``gemv_config``'s)."""
    if not _covered(x, weight):
        return F.linear(x, dense(weight))
    y = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_row(x), weight, y, PRO_NONE, _Call(), pdl, config)
    return y


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, weight: Weight,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.linear.reference.add_rms_norm_linear``."""
    if not _covered(x, weight, residual):
        normed, residual = triton_norm.add_rms_norm(x, residual, norm_w, eps, pdl)
        return linear(normed, weight, pdl), residual
    y, res = _outputs(x, residual, weight.shape[0])
    _launch(_row(x), weight, y, PRO_ADD_RMS_NORM, _Call(a=_opt_row(residual), nw=norm_w, res=res, eps=eps), pdl)
    return y, res


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
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.linear.reference.add_rms_norm_conv_linear``."""
    conv_dim, kernel_size = conv_w.shape
    fits = (
        _covered(x, weight, residual) and conv_dim <= weight.shape[0]
        and conv_states.shape[1:] == (conv_dim, kernel_size - 1) and conv_states.stride(-1) == 1
        and conv_w.stride(-1) == 1 and kernel_size >= 2
    )  # fmt: skip
    if not fits:
        y, residual = add_rms_norm_linear(x, residual, norm_w, eps, weight, pdl)
        conv = triton_conv1d.causal_conv1d_update(
            y[:, :conv_dim], conv_w, None, conv_states, read_slots, write_slots, pdl
        )
        return torch.cat((conv, y[:, conv_dim:]), dim=-1), residual
    y, res = _outputs(x, residual, weight.shape[0])
    call = _Call(a=_opt_row(residual), nw=norm_w, res=res, eps=eps, conv=(conv_w, conv_states, read_slots, write_slots))
    _launch(_row(x), weight, y, PRO_ADD_RMS_NORM, call, pdl)
    return y, res


def gated_rms_norm_linear(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: Weight, pdl: bool = False
) -> torch.Tensor:
    """``kernels.linear.reference.gated_rms_norm_linear`` (``x``, ``gate`` ``[1, H, D]``)."""
    head = x.shape[-1]
    flat = x.reshape(x.shape[0], -1)
    if not _covered(flat, weight) or gate.shape != x.shape or head & (head - 1) or norm_w.shape != (head,):
        return linear(triton_norm.gated_rms_norm(x, gate, norm_w, eps, pdl).reshape(flat.shape), weight, pdl)
    y = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_row(flat), weight, y, PRO_GATED_RMS_NORM, _Call(a=_heads(gate), nw=norm_w, eps=eps, head=head), pdl)
    return y


def gated_rms_norm_linear_route(
    x: torch.Tensor, gate: torch.Tensor, norm_w: torch.Tensor, eps: float, weight: Weight,
    residual: torch.Tensor, router_t: torch.Tensor, post_norm_w: torch.Tensor, acc: torch.Tensor, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``kernels.linear.reference.gated_rms_norm_linear_route``: the residual sum and the router's
    partial logits in the projection's programs (``kernels/moe/route_partial.py``)."""
    head = x.shape[-1]
    flat = x.reshape(x.shape[0], -1)
    route = _route_operands(residual, router_t, post_norm_w, acc, weight.shape[0])
    if (route is None or not _covered(flat, weight) or gate.shape != x.shape or head & (head - 1)
            or norm_w.shape != (head,)):  # fmt: skip
        y = gated_rms_norm_linear(x, gate, norm_w, eps, weight, pdl)
        return add_route_partial(y, residual, router_t, post_norm_w, acc)
    s = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_row(flat), weight, s, PRO_GATED_RMS_NORM, _Call(a=_heads(gate), nw=norm_w, eps=eps, head=head, route=route), pdl)
    return s


def sigmoid_gate_linear_route(
    x: torch.Tensor, gate: torch.Tensor, weight: Weight,
    residual: torch.Tensor, router_t: torch.Tensor, post_norm_w: torch.Tensor, acc: torch.Tensor, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``kernels.linear.reference.sigmoid_gate_linear_route`` (see ``gated_rms_norm_linear_route``)."""
    route = _route_operands(residual, router_t, post_norm_w, acc, weight.shape[0])
    if route is None or not _covered(x, weight) or gate.shape != x.shape:
        return add_route_partial(sigmoid_gate_linear(x, gate, weight, pdl), residual, router_t, post_norm_w, acc)
    s = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_row(x), weight, s, PRO_SIGMOID_GATE, _Call(a=_row(gate), route=route), pdl)
    return s


def _route_operands(
    residual: torch.Tensor, router_t: torch.Tensor, post_norm_w: torch.Tensor, acc: torch.Tensor, num_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The route epilogue's operands, or None where the kernel cannot take them (one row of
    ``num_n``, a contiguous ``[num_n, E + 1]`` router, an accumulator of its width)."""
    cols = router_t.shape[-1]
    fits = (
        residual.numel() == num_n and router_t.shape == (num_n, cols) and router_t.is_contiguous()
        and post_norm_w.shape == (num_n,) and acc_fits(acc, cols) and router_t.dtype == residual.dtype
    )  # fmt: skip
    return (_row(residual), router_t, post_norm_w, acc) if fits else None


def sigmoid_gate_linear(x: torch.Tensor, gate: torch.Tensor, weight: Weight, pdl: bool = False) -> torch.Tensor:
    """``kernels.linear.reference.sigmoid_gate_linear``."""
    if not _covered(x, weight) or gate.shape != x.shape:
        return linear(x * torch.sigmoid(gate), weight, pdl)
    y = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_row(x), weight, y, PRO_SIGMOID_GATE, _Call(a=_row(gate)), pdl)
    return y


def add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float, router_w: Weight,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernels.linear.reference.add_rms_norm_router``: ``(router logits, normed, x + residual)``."""
    if not _covered(x, router_w, residual):
        normed, residual = triton_norm.add_rms_norm(x, residual, norm_w, eps, pdl)
        return linear(normed, router_w, pdl), normed, residual
    logits, res = _outputs(x, residual, router_w.shape[0])
    normed = torch.empty_like(x)
    _launch(_row(x), router_w, logits, PRO_ADD_RMS_NORM, _Call(a=_opt_row(residual), nw=norm_w, res=res, normed=normed, eps=eps), pdl)
    return logits, normed, res


def _outputs(x: torch.Tensor, residual: torch.Tensor | None, num_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` ``[1, num_n]`` and the residual stream's next value (``x`` itself when it starts here)."""
    y = torch.empty((1, num_n), dtype=x.dtype, device=x.device)
    return y, x if residual is None else torch.empty_like(x)


def _opt_row(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else _row(x)


def _heads(gate: torch.Tensor) -> torch.Tensor:
    """``[1, H, D]`` whose rows the kernel may read as one flat row (unit stride within a head,
    heads ``D`` apart), else a contiguous copy."""
    if gate.stride(-1) == 1 and gate.stride(-2) == gate.shape[-1]:
        return gate
    return gate.contiguous()
