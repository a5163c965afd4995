"""Depthwise causal conv1d + SiLU decode step: Triton version of ``kernels.gdn.conv1d.causal_conv1d_update``.

Shapes (as the reference): ``x`` ``[B, D]`` with unit last stride, ``weight`` ``[D, K]``, ``bias``
``[D] | None``, ``conv_states`` ``[num_slots, D, K-1]`` with unit last stride, ``read_slots`` /
``write_slots`` ``[B]`` int64. Returns ``[B, D]`` in ``x.dtype``.

One program per (sequence, block of ``BD`` channels) fuses gather, concat, conv, bias, SiLU, shift
and scatter: it loads the ``K-1`` state columns from ``read_slots[i]`` and the new input as the last
window column, and stores window columns ``1..K-1`` to ``write_slots[i]``::

    window:    | s0 | s1 | s2 | x |        out = silu(sum(weight * window) + bias)
    new state:      | s1 | s2 | x |

Rounding follows the reference: the state is rounded to ``x.dtype`` on the way in, the window to
``weight.dtype`` for the conv (accumulated in fp32, rounded to ``weight.dtype``), SiLU in fp32 rounded
to ``weight.dtype``, then the output to ``x.dtype``.

Read-before-write: loads come before a CTA barrier, stores after, so ``read_slots[i] ==
write_slots[i]`` shifts in place. Programs cannot be ordered across sequences: ``write_slots`` must
be distinct and must not include a slot another sequence reads in the same call.

Memory traffic at the 35B-A3B decode shape (D = 8192 channels, K = 4, bf16), per layer and
sequence: x 16 KiB + weight 64 KiB + state 48 KiB read, state 48 KiB + out 16 KiB written:
~192 KiB, in one launch where the reference takes several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


__all__ = ["causal_conv1d_update", "conv_operands"]

_MAX_BD = 256


@triton.jit
def causal_conv1d_update_kernel(
    x,
    weight,
    bias,
    conv_states,
    read_slots,
    write_slots,
    o,
    s_xb,
    s_wd,
    s_sn,
    s_sd,
    D,
    K: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    x_dtype = x.dtype.element_ty
    w_dtype = weight.dtype.element_ty

    o_d = i_d * BD + tl.arange(0, BD)
    o_k = tl.arange(0, BK)  # window columns
    m_d = o_d < D
    m_s = m_d[:, None] & (o_k[None, :] < K - 1)
    m_next = m_d[:, None] & (o_k[None, :] < K - 2)

    i_read = tl.load(read_slots + i_b).to(tl.int64)
    i_write = tl.load(write_slots + i_b).to(tl.int64)
    o_s = o_d[:, None] * s_sd + o_k[None, :]
    p_read = conv_states + i_read * s_sn + o_s
    b_s = tl.load(p_read, mask=m_s, other=0.0).to(x_dtype)  # [BD, BK], window columns 0..K-2
    # Window columns 1..K-2 (the state shifted by one) come from a second load, not a register shuffle.
    b_next = tl.load(p_read + 1, mask=m_next, other=0.0).to(x_dtype)  # [BD, BK]
    b_x = tl.load(x + i_b * s_xb + o_d, mask=m_d, other=0.0)  # [BD]
    b_w = tl.load(weight + o_d[:, None] * s_wd + o_k[None, :], mask=m_d[:, None] & (o_k[None, :] < K), other=0.0)

    b_win = tl.where(o_k[None, :] == K - 1, b_x[:, None], b_s)
    b_acc = tl.sum(b_win.to(w_dtype).to(tl.float32) * b_w.to(tl.float32), 1)  # [BD]
    if HAS_BIAS:
        b_acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_acc = b_acc.to(w_dtype).to(tl.float32)
    b_out = (b_acc / (1.0 + tl.exp(-b_acc))).to(w_dtype)
    tl.store(o + i_b * D + o_d, b_out.to(o.dtype.element_ty), mask=m_d)

    b_new = tl.where(o_k[None, :] == K - 2, b_x[:, None], b_next)
    # Every thread of the program has loaded its part of the state before any shifts it in place.
    tl.debug_barrier()
    tl.store(conv_states + i_write * s_sn + o_s, b_new.to(conv_states.dtype.element_ty), mask=m_s)


def conv_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` ``[rows, D]``, ``weight`` ``[D, K]`` and ``bias`` with unit last strides, after checking
    the shapes against ``conv_states`` ``[num_slots, D, K-1]`` (unit last stride: written in place)."""
    dim, kernel_size = x.shape[1], weight.shape[1]
    if kernel_size < 2 or weight.shape[0] != dim:
        raise ValueError(f"weight must be [{dim}, K] with K >= 2, got {tuple(weight.shape)}")
    if conv_states.shape[1:] != (dim, kernel_size - 1) or conv_states.stride(-1) != 1:
        raise ValueError(
            f"conv_states must be [num_slots, {dim}, {kernel_size - 1}] with unit last stride, "
            f"got shape {tuple(conv_states.shape)} strides {conv_states.stride()}"
        )
    x, weight = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight))
    return x, weight, None if bias is None else bias.contiguous()


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode token per sequence; every sequence has an initial state (``pdl``: launched
    under programmatic dependent launch, ``kernels/common/pdl.py``)."""
    num_seqs, dim = x.shape
    kernel_size = weight.shape[1]
    x, weight, bias = conv_operands(x, weight, bias, conv_states)
    out = torch.empty((num_seqs, dim), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    block_d = min(triton.next_power_of_2(dim), _MAX_BD)
    grid = (num_seqs, triton.cdiv(dim, block_d))
    causal_conv1d_update_kernel[grid](
        x, weight, bias, conv_states, read_slots, write_slots, out,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), dim,
        K=kernel_size, BK=triton.next_power_of_2(kernel_size), BD=block_d, HAS_BIAS=bias is not None,
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out
