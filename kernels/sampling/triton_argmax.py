"""Row-wise argmax of logits on the GPU: Triton version of ``kernels.sampling.reference.argmax``.

``torch.argmax`` over one ``[1, 248320]`` row (the 35B-A3B vocabulary) is one reduction kernel
with most of its programs idle; here ``P`` programs a row each reduce a chunk to
(key, first index), and one more launch picks the row's winner among the ``P`` partials. Keys are
the fp32 values' bits mapped to int32 so that integer order is float order, with every NaN above
+inf (``torch.argmax``'s NaN rule); ties go to the smallest index, which is the first occurrence
since chunks are in index order (-0.0 and +0.0 are one key, as they compare equal). Inputs of any
float dtype are compared after an exact upcast to fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.sampling.reference import argmax as _reference

__all__ = ["argmax"]

_BLOCK = 1024
_MAX_INDEX = 2**31 - 1


@triton.jit
def _keys(b_x):
    """int32 keys of fp32 values in the same order, NaN above +inf (-0.0 as +0.0: they are equal)."""
    bits = tl.where(b_x == 0.0, 0.0, b_x).to(tl.int32, bitcast=True)
    keys = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(b_x != b_x, 0x7FFFFFFF, keys)


@triton.jit
def _best(keys, idx):
    """The largest key and the smallest index holding it."""
    top = tl.max(keys, axis=0)
    return top, tl.min(tl.where(keys == top, idx, 0x7FFFFFFF), axis=0)


@triton.jit
def argmax_partial_kernel(p_x, p_key, p_idx, V, s_xr, CHUNK, BLOCK: tl.constexpr, PDL: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    n_c = tl.num_programs(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    o = tl.arange(0, BLOCK)
    best_key = tl.full([BLOCK], -0x7FFFFFFF - 1, tl.int32)
    best_idx = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
    for start in range(i_c * CHUNK, tl.minimum((i_c + 1) * CHUNK, V), BLOCK):
        o_v = start + o
        b_x = tl.load(p_x + i_r * s_xr + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
        keys = tl.where(o_v < V, _keys(b_x), -0x7FFFFFFF - 1)
        # Strictly greater: an earlier block's equal key keeps its smaller index.
        take = keys > best_key
        best_idx = tl.where(take, o_v.to(tl.int32), best_idx)
        best_key = tl.where(take, keys, best_key)
    top, first = _best(best_key, best_idx)
    tl.store(p_key + i_r * n_c + i_c, top)
    tl.store(p_idx + i_r * n_c + i_c, first)


@triton.jit
def argmax_final_kernel(
    p_key, p_idx, p_out, p_copy, NP, BP: tl.constexpr, COPY: tl.constexpr, PDL: tl.constexpr
):
    i_r = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    o = tl.arange(0, BP)
    keys = tl.load(p_key + i_r * NP + o, mask=o < NP, other=-0x7FFFFFFF - 1)
    idx = tl.load(p_idx + i_r * NP + o, mask=o < NP, other=0x7FFFFFFF)
    _top, first = _best(keys, idx)
    tl.store(p_out + i_r, first.to(tl.int64))
    if COPY:
        tl.store(p_copy + i_r, first.to(tl.int64))


def argmax(
    logits: torch.Tensor, copy_to: torch.Tensor | None = None, out: torch.Tensor | None = None, pdl: bool = False
) -> torch.Tensor:
    """``[S, V]`` float logits (unit last stride) -> ``[S]`` int64: ``torch.argmax(logits, -1)``;
    ``copy_to`` (``[S]`` int64, contiguous) is written with the same ids by the same kernel;
    ``out`` (same form) receives the ids and is returned instead of a new tensor."""
    for name, buf in (("copy_to", copy_to), ("out", out)):
        if buf is not None and (buf.shape != logits.shape[:1] or buf.dtype != torch.int64 or not buf.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous int64 [{logits.shape[0]}], got {tuple(buf.shape)} {buf.dtype}")
    if logits.dim() != 2 or not logits.dtype.is_floating_point or logits.shape[1] > _MAX_INDEX:
        return _reference(logits, copy_to, out)
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return _reference(logits, copy_to, out)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # ~2 blocks a program, at most 256 partials a row (one program reduces them).
    chunks = max(1, min(256, triton.cdiv(vocab, 2 * _BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), _BLOCK) * _BLOCK
    chunks = triton.cdiv(vocab, chunk)
    keys = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    argmax_partial_kernel[(rows, chunks)](logits, keys, idx, vocab, logits.stride(0), chunk, BLOCK=_BLOCK,
                                          num_warps=4, PDL=pdl, launch_pdl=pdl)  # fmt: skip
    argmax_final_kernel[(rows,)](keys, idx, out, copy_to if copy_to is not None else out, chunks,
                                 BP=triton.next_power_of_2(chunks), COPY=copy_to is not None, num_warps=4,
                                 PDL=pdl, launch_pdl=pdl)  # fmt: skip
    return out
