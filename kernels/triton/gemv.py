"""Single-token dense projection (decode's output projections): Triton version of ``kernels.linear.linear``.

``x`` ``[1, K]`` (or ``[K]``-like ``[..., K]`` with one row), ``weight`` ``[N, K]`` with a unit last
stride, one dtype; returns ``[..., N]`` in ``x.dtype`` with fp32 accumulation. Any other shape
(more than one row, mixed dtypes) goes to ``torch.nn.functional.linear``.

Why: at batch 1 the attention ``o_proj`` and GDN ``out_proj`` of the 35B-A3B shape (``[2048,
4096]``, 16.8 MB each, 40 per step) ran in the H200 profile as cuBLAS split-K GEMVs at 2.3 TB/s
plus a split-K reduce launch (355 µs per step together, 1.9 TB/s). This kernel has the shape of
the MoE gate/up stage that a CUDA-graph sweep put at 3.2 TB/s (``kernels.triton.fused_moe``:
``BLOCK_N`` 4 rows per program, ``BLOCK_K`` 1024, 8 warps, 3 stages; 512 programs for N = 2048),
with elementwise fp32 accumulators reduced once at the end and no split-K: predicted ~210 µs
per step for the 40 calls. Not measured yet; ``kernels.dispatch`` uses it only with
``PHLOEM_TRITON_GEMV=1`` until a ``phloem bench decode`` run shows the gain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from phloem.kernels.triton._pdl import LAUNCH_PDL, PDL

__all__ = ["linear"]

_BLOCK_N, _BLOCK_K, _NUM_WARPS, _NUM_STAGES = 4, 1024, 8, 3


@triton.jit
def gemv_kernel(p_x, p_w, p_y, N, K, s_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if PDL:
        gdc_wait()  # the previous kernel's writes first (kernels/triton/_pdl.py)
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(p_w + o_n[:, None] * s_wn + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc += b_w.to(tl.float32) * b_x[None, :]
    tl.store(p_y + o_n, tl.sum(acc, axis=1).to(p_y.dtype.element_ty), mask=m_n)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T``; one row through the kernel, anything else through ``F.linear``."""
    num_k = x.shape[-1]
    if x.numel() != num_k or weight.dim() != 2 or weight.shape[1] != num_k or weight.stride(1) != 1 or (
            x.dtype != weight.dtype):
        return F.linear(x, weight)
    num_n = weight.shape[0]
    y = torch.empty((*x.shape[:-1], num_n), dtype=x.dtype, device=x.device)
    block_k = min(_BLOCK_K, triton.next_power_of_2(num_k))
    gemv_kernel[(triton.cdiv(num_n, _BLOCK_N),)](
        x.contiguous(), weight, y, num_n, num_k, weight.stride(0), BLOCK_N=_BLOCK_N, BLOCK_K=block_k,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, launch_pdl=LAUNCH_PDL,
    )  # fmt: skip
    return y
