"""One-shot all-reduce fused with the residual add and RMSNorm that follow it (tensor parallelism).

Reference: ``kernels.norm.reference.all_reduce_add_rms_norm`` (the ranks' partial sums added in fp32 in rank
order, rounded to the input dtype, then ``add_rms_norm``). Replaces, per row-parallel output under
TP, an NCCL all-reduce (a ring's latency per call at decode sizes, 81 calls a step at the
35B-A3B shape) plus the ``add_rms_norm`` launch.

How it works (vLLM's and SGLang's custom all-reduce, one-shot flavour): every rank owns a buffer
that all ranks have mapped (CUDA IPC, ``engine.parallel.one_shot_allreduce``). One program per row:

1. copies its row of this rank's partial sum into its buffer;
2. writes the row's epoch into every rank's flag slot ``[rank, row]`` (release, system scope);
3. waits until every rank's epoch in its own flags ``[q, row]`` has reached its epoch (acquire);
4. reads the row from every rank's buffer, sums in fp32 in rank order (so every rank gets the same
   bits), rounds to the dtype as the all-reduce would, then adds the residual and normalises as
   ``kernels.norm.triton_norm.add_rms_norm`` does, writing both outputs.

Under programmatic dependent launch the kernel waits for the kernel before it (``gdc_wait``) before
it reads or writes anything, so the argument below holds as without it: a launch starts its work
only once the launch before it on its stream has completed.

Epochs are int64 counters in device memory, one per row (program), incremented by the kernel itself:
a CUDA graph replays the same launch and the epochs still advance, and no host state is needed.
Every rank runs the same sequence of launches with the same row counts (SPMD), so row ``r``'s
counter agrees on all ranks. The buffer is double-buffered by epoch parity: a rank writes epoch
``e``'s row only after it saw every peer's epoch ``e - 1`` flag for that row, which a peer sets
only after its launch of epoch ``e - 2`` (an earlier kernel on its stream) finished reading. A
peer may run one epoch ahead (its flag then already reads ``e + 1``), hence the ``>=`` wait.

Bytes at the 35B-A3B decode shape (bf16, hidden 2048, one token, two ranks): 4 KiB written, 8 KiB
read over NVLink and locally, the residual and weight read, 8 KiB written: latency-bound; the
point is one launch and two flag round trips instead of a ring all-reduce and a norm launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.norm.triton_norm import _launch_config, _rows

__all__ = ["one_shot_add_rms_norm"]


@triton.jit
def one_shot_add_rms_norm_kernel(
    x, residual, weight, o, o_residual, buffers, flags, epochs,
    rank, s_x, s_r, D, half, eps,
    WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, BD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        # Before anything is read: x, and the epochs and buffers the previous launch wrote.
        gdc_wait()
    i_r = tl.program_id(0)
    dt = x.dtype.element_ty
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    epoch = tl.load(epochs + i_r) + 1
    tl.store(epochs + i_r, epoch)
    row = (epoch % 2) * half + i_r.to(tl.int64) * D
    own = tl.load(buffers + rank).to(tl.pointer_type(dt))
    tl.store(own + row + o_d, tl.load(x + i_r.to(tl.int64) * s_x + o_d, mask=m_d), mask=m_d)
    # Every thread's row store is done before the flags say so (the release is cumulative).
    tl.debug_barrier()
    for q in tl.static_range(WORLD):
        peer_flags = tl.load(flags + q).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(peer_flags + rank * MAX_ROWS + i_r, epoch, sem="release", scope="sys")
    own_flags = tl.load(flags + rank).to(tl.pointer_type(tl.int64))
    for q in tl.static_range(WORLD):
        while tl.atomic_add(own_flags + q * MAX_ROWS + i_r, 0, sem="acquire", scope="sys") < epoch:
            pass
    tl.debug_barrier()
    b_sum = tl.zeros([BD], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        peer = tl.load(buffers + q).to(tl.pointer_type(dt))
        b_sum += tl.load(peer + row + o_d, mask=m_d, other=0.0, volatile=True).to(tl.float32)
    b_sum = b_sum.to(dt).to(tl.float32)  # the all-reduced value, as stored by an all-reduce
    if HAS_RESIDUAL:
        b_sum += tl.load(residual + i_r.to(tl.int64) * s_r + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_sum = b_sum.to(dt).to(tl.float32)  # the norm reads the sum as stored (add_rms_norm)
    tl.store(o_residual + i_r.to(tl.int64) * D + o_d, b_sum.to(dt), mask=m_d)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_sum * b_sum) / D + eps)
    tl.store(o + i_r.to(tl.int64) * D + o_d, (b_sum * b_rstd * (1.0 + b_w)).to(dt), mask=m_d)


def one_shot_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    buffers: torch.Tensor,
    flags: torch.Tensor,
    epochs: torch.Tensor,
    rank: int,
    half: int,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(all_reduce(x), residual, weight, eps)`` across the ranks whose buffers are mapped.

    Args:
        x: this rank's partial sum ``[..., D]``; ``residual`` (or None) the same shape and dtype.
        buffers: int64 ``[W]``, the device address of each rank's data buffer (``2 * half``
            elements of ``x.dtype``), this rank's at ``rank``.
        flags: int64 ``[W]``, the address of each rank's flags: int64 ``[W, epochs.numel()]``.
        epochs: int64 ``[R]``, this rank's per-row counters (R bounds the rows of one call).

    Every rank must make the same calls with the same shapes, in the same order. ``pdl``: launched
    under programmatic dependent launch (``kernels/common/pdl.py``), inside the decode step's chain.
    """
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x, got {tuple(residual.shape)} {residual.dtype} and "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    rows = _rows(x)
    n, dim = rows.shape
    max_rows = epochs.numel()
    if n > max_rows or n * dim > half:
        raise ValueError(f"{n} rows of {dim} exceed the one-shot buffer ({max_rows} rows, {half} elements)")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_rows = _rows(residual) if residual is not None else rows
    if n:
        one_shot_add_rms_norm_kernel[(n,)](
            rows, res_rows, weight.contiguous(), out, out_residual, buffers, flags, epochs,
            rank, rows.stride(0), res_rows.stride(0), dim, half, eps,
            WORLD=buffers.numel(), MAX_ROWS=max_rows, HAS_RESIDUAL=residual is not None, **_launch_config(dim),
            PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out, out_residual
