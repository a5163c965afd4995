"""Split-KV paged decode attention (one query token per sequence): Triton version of a pure-decode
step of ``kernels.attention.reference.paged_attention``.

Shapes: ``q`` ``[B, Hq, D]``; ``kv_cache`` ``[num_pages, 2, page_size, Hkv, D]`` (K plane 0, V plane 1,
unit last stride); ``kv_indptr`` ``[B + 1]``, ``kv_indices`` ``[>= nnz]``, ``kv_last_page_len`` ``[B]``
int32, as FlashInfer plans them (``kernels.attention.flashinfer.page_indices``). Query head ``h``
reads KV head ``h // G`` (``G = Hq // Hkv``); scores, softmax and the weighted sum accumulate in fp32
and the output is cast to ``q.dtype``. Every sequence has at least one key.

Two launches, both with a grid fixed by the shapes alone (CUDA-graph safe for any lengths):

1. ``(Hkv, B, S)`` programs, ``S = max_splits`` (split slowest: the busy programs of short
   sequences are dispatched first). Sequence ``i`` of ``seq_len`` keys is cut, in the kernel,
   into ``num_active = cdiv(seq_len, split_len)`` splits of
   ``split_len = max(MIN_SPLIT, round_up(cdiv(seq_len, S), MIN_SPLIT))`` keys; programs past
   ``num_active`` exit at once (before ``gdc_wait``: the page lists are step inputs)::

       keys  0 ...... split_len-1 | split_len ...... 2*split_len-1 | ... seq_len-1 | (idle programs)
             program s=0          | s=1                            | s=num_active-1

   A program loads the ``G`` query heads of its KV head once (padded with zero rows to
   ``BLOCK_G >= 16``, the smallest M of ``tl.dot``), walks its keys in tiles of ``BLOCK_T`` tokens
   (each token's page id through ``kv_indices``; tiles past the split's end are masked), keeps an
   fp32 online softmax (base 2) and writes its normalised partial output ``[G, D]`` fp32 and
   log-sum-exp ``[G]`` to a workspace ``[B, Hkv, S, G, (D)]``. With ``S == 1`` (a host-side
   choice) it writes the output itself and the merge is not launched.
2. ``(B, Hq, D // BLOCK_D)`` programs combine the ``num_active`` partials of a query head (computed
   as above, so unwritten workspace rows are never read).

Why ``tl.dot`` (tensor cores): at G 8, D 256 each key costs 8 flops per byte of K+V, about half
a GPU's fp32 CUDA-core rate at full bandwidth, and the ``[G, BLOCK_T, D]`` product of a broadcast
multiply would not fit in registers; padding 8 rows to 16 wastes tensor-core cycles that are idle
anyway. ``P`` is rounded to the KV dtype for the PV product (as FlashInfer and FlashAttention do);
fp32 inputs use ``ieee`` dots, so fp32 matches the reference tightly.

With the prologue (``paged_decode_attention_prologue``, ``PROLOGUE``) the split launch also does
what ``kernels.attention.triton_qk_norm_rope.qk_norm_rope_gate_store`` does before it: ``q`` is the projection's
``| query | gate |`` per head, every active program normalises and rotates its ``G`` query heads in
registers (``triton_qk_norm_rope.norm_rope_rows``: the reference's rounding), split 0 copies their gates
out for ``o_proj``, and the split holding the sequence's last key writes the step's K and V row
into its page (``triton_qk_norm_rope.norm_rope_store_kv``, the same row code as the separate kernel, so
the cache is the same bit for bit) and then, after a CTA barrier, reads it like any other key. No
other program reads that row, so none waits: one launch fewer in every attention layer of a
decode step, and the queries never go through memory.

A split of one ``MIN_SPLIT`` tile of keys (every split of a short sequence) loads that tile before
``gdc_wait`` (``PRELOAD``), all but the step's own key, which its split loads again after writing
it: the key loads overlap the kernels before instead of following the wait. Longer splits walk as
without it. The tile held through the prologue costs registers, so the split kernel is capped at
``DecodeAttentionConfig.max_registers`` to keep 4 programs an SM for the long-context grid.

The kernels are in ``triton_decode_kernel``; pure-decode steps reach them through
``kernels.attention.flashinfer`` (``TritonDecodePlan``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from phloem.kernels.attention.triton_decode_kernel import decode_attention_merge_kernel, decode_attention_split_kernel
from phloem.kernels.common import device as _device

__all__ = [
    "DecodeAttentionConfig", "default_max_splits", "paged_decode_attention", "paged_decode_attention_prologue",
    "paged_decode_attention_tuned",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 512
# Splits per (sequence, KV head) at most: bounds the workspace and the merge's loop.
_MAX_SPLITS = 256
# Programs to aim for per SM in the split launch (see ``default_max_splits``).
_PROGRAMS_PER_SM = 4
# Elements of a merge tile ([BLOCK_S, BLOCK_D] fp32): 32 registers a thread over 4 warps.
_MERGE_TILE = 4096


class DecodeAttentionConfig(NamedTuple):
    """Tokens per tile, warps and pipeline stages of the split launch, and the shortest split (keys).

    ``default_max_splits`` assumes the defaults' occupancy (4 programs per SM). Benchmark tools
    pass another one to ``paged_decode_attention_tuned`` / ``paged_decode_attention_prologue``."""

    block_t: int = 32
    num_warps: int = 4
    num_stages: int = 2
    min_split: int = 16
    # ptxas's cap a thread (0: none). 128 keeps 4 programs an SM (4 warps each) with the one-tile
    # preload; uncapped, 3 fit and a long-context grid sized for 4 runs in two waves.
    max_registers: int = 128


_DEFAULT_CONFIG = DecodeAttentionConfig()


def default_max_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per (sequence, KV head): one wave of ``_PROGRAMS_PER_SM`` programs per SM, less 2%.

    The grid must not depend on the lengths, so it is sized for a long context: with the default
    tiles (128 registers, 41 KiB of shared memory) 4 programs fit an SM, and one full wave of them
    keeps enough loads in flight to run near the memory bandwidth, where fewer, longer splits fall
    off. A grid just over one wave leaves its last programs to a second one, hence the floor, and
    the 2% of the SMs' slots left to the kernels beside it under PDL. 132 SMs, Hkv 2: batch 1 -> 256
    (the cap), 4 -> 64, 16 -> 16, 64 -> 4, 259+ -> 1.
    Short sequences use only the splits ``MIN_SPLIT`` allows (1K at batch 1: 64 of 16 keys).
    """
    slots = _PROGRAMS_PER_SM * num_sms * 49 // 50
    return max(1, min(_MAX_SPLITS, slots // (num_seqs * num_kv_heads)))


def _check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != q.shape[2]:
        raise ValueError(
            f"q must be [B, Hq, D] and kv_cache [num_pages, 2, page_size, Hkv, D], "
            f"got q {tuple(q.shape)} and kv_cache {tuple(kv_cache.shape)}"
        )
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[2:4]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq must be a multiple of Hkv, got Hq={num_q_heads}, Hkv={num_kv_heads}")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a power of two in [16, {_MAX_HEAD_DIM}], got {head_dim}")
    if page_size & (page_size - 1) or page_size == 0:
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if q.dtype not in _DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(f"q and kv_cache must share a dtype of {_DTYPES}, got {q.dtype} and {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a unit last stride, got strides {kv_cache.stride()}")
    shapes = {"kv_indptr": (num_seqs + 1,), "kv_last_page_len": (num_seqs,), "kv_indices": None}
    for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        want = shapes[name]
        if t.dtype != torch.int32 or t.dim() != 1 or (want is not None and tuple(t.shape) != want):
            raise ValueError(
                f"{name} must be 1-D int32{f' of shape {want}' if want else ''}, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache must be on {q.device}, got {kv_cache.device}")
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device
    ):
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}"
        )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float,
    max_splits: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys: ``[B, Hq, D]`` in ``q.dtype``.

    ``max_splits``: programs per (sequence, KV head) at most, capped at 256 (None: ``default_max_splits``).
    ``out``: written in place when given. ``pdl``: launched under programmatic dependent launch
    (``kernels/common/pdl.py``). Raises ``ValueError`` for inputs the kernels do not cover.
    """
    return paged_decode_attention_tuned(
        q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, scale, max_splits, out, _DEFAULT_CONFIG, pdl
    )


def paged_decode_attention_tuned(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float,
    max_splits: int | None,
    out: torch.Tensor | None,
    config: DecodeAttentionConfig,
    pdl: bool = False,
) -> torch.Tensor:
    """``paged_decode_attention`` with an explicit launch configuration (benchmark sweeps)."""
    _check_inputs(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, out)
    indices = (kv_indptr, kv_indices, kv_last_page_len)
    return _launch(q, kv_cache, indices, scale, max_splits, out, config, None, pdl)


class _Prologue(NamedTuple):
    """The fused prologue's operands (``paged_decode_attention_prologue``)."""

    key: torch.Tensor
    value: torch.Tensor
    q_norm_w: torch.Tensor
    k_norm_w: torch.Tensor
    positions: torch.Tensor
    inv_freq: torch.Tensor
    slot_mapping: torch.Tensor
    gate: torch.Tensor
    eps: float


def paged_decode_attention_prologue(
    q_gate: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float,
    max_splits: int | None = None,
    pdl: bool = False,
    config: DecodeAttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.attention.qk_norm_rope.qk_norm_rope_gate_store`` then ``paged_decode_attention``, the first
    inside the split launch: ``(out [B, Hq, D], gate [B, Hq * D])``, and the step's ``key`` (normalised,
    rotated) and ``value`` ``[B, Hkv, D]`` written into ``kv_cache`` at ``slot_mapping`` ``[B]``.

    ``q_gate`` ``[B, Hq, 2D]`` is the ``q_proj`` output per head (``| query | gate |``; any strides
    with a unit last one, e.g. a view of the fused qkv projection). Every split program normalises
    and rotates its KV head's query heads itself (the same rounding as ``kernels.attention.triton_qk_norm_rope``,
    so the same values whichever kernel made them), split 0 copies their gates, and the split holding
    a sequence's last key writes that key and its value before attending, so one launch replaces two
    and the queries never go through memory. Each sequence's ``slot_mapping`` entry must be its last
    key's slot in the page lists (as a step plans them); a sequence of length 0 is not covered.
    ``pdl`` and ``config`` as for ``paged_decode_attention_tuned`` (None: the default tiles).
    """
    num_seqs, num_q_heads, width = q_gate.shape if q_gate.dim() == 3 else (0, 0, -1)
    head_dim = kv_cache.shape[-1] if kv_cache.dim() == 5 else -1
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else -1
    rows = (num_seqs, num_kv_heads, head_dim)
    if width != 2 * head_dim or key.shape != rows or value.shape != rows or key.dtype != q_gate.dtype:
        raise ValueError(
            f"q_gate must be [B, Hq, 2D] and key, value [B, Hkv, D] of q_gate's dtype for kv_cache "
            f"[pages, 2, page_size, Hkv, D], got q_gate {tuple(q_gate.shape)}, key {tuple(key.shape)} {key.dtype}, "
            f"value {tuple(value.shape)}, kv_cache {tuple(kv_cache.shape)}"
        )
    if q_norm_w.shape != (head_dim,) or k_norm_w.shape != (head_dim,) or 2 * inv_freq.shape[0] > head_dim:
        raise ValueError(
            f"norm weights must be [{head_dim}] and 2 * rotary half <= {head_dim}, got {tuple(q_norm_w.shape)}, "
            f"{tuple(k_norm_w.shape)} and inv_freq {tuple(inv_freq.shape)}"
        )
    if positions.shape != (num_seqs,) or slot_mapping.shape != (num_seqs,):
        raise ValueError(f"positions and slot_mapping must be [{num_seqs}], got {tuple(positions.shape)}, {tuple(slot_mapping.shape)}")
    q_gate, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_gate, key, value))
    _check_inputs(q_gate[..., :head_dim], kv_cache, kv_indptr, kv_indices, kv_last_page_len, None)
    gate = torch.empty((num_seqs, num_q_heads * head_dim), dtype=q_gate.dtype, device=q_gate.device)
    pro = _Prologue(key, value, q_norm_w.contiguous(), k_norm_w.contiguous(), positions.contiguous(),
                    inv_freq.float().contiguous(), slot_mapping.contiguous(), gate, eps)  # fmt: skip
    indices = (kv_indptr, kv_indices, kv_last_page_len)
    out = _launch(q_gate, kv_cache, indices, scale, max_splits, None, config or _DEFAULT_CONFIG, pro, pdl)
    return out, gate


def _launch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    max_splits: int | None,
    out: torch.Tensor | None,
    config: DecodeAttentionConfig,
    pro: _Prologue | None,
    pdl: bool,
) -> torch.Tensor:
    """The split launch (and the merge): ``q`` ``[B, Hq, D]``, or with ``pro`` ``q_gate`` ``[B, Hq, 2D]``."""
    if max_splits is not None and max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    if config.block_t < 16 or config.block_t & (config.block_t - 1) or config.min_split < 1:
        raise ValueError(f"block_t must be a power of two >= 16 and min_split >= 1, got {config}")
    num_seqs, num_q_heads = q.shape[:2]
    page_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    num_splits = max_splits or default_max_splits(num_seqs, num_kv_heads, _device.num_sms(q.device))
    num_splits = min(num_splits, _MAX_SPLITS)
    if num_splits > 1:
        rows = (num_seqs, num_kv_heads, num_splits, group)
        o_part = torch.empty((*rows, head_dim), dtype=torch.float32, device=q.device)
        lse_part = torch.empty(rows, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # unused: the split program writes the output
    if pro is not None:
        prologue = (pro.key, pro.value, *pro.key.stride()[:2], *pro.value.stride()[:2], pro.q_norm_w, pro.k_norm_w,
                    pro.positions, pro.inv_freq, pro.slot_mapping, pro.gate, pro.gate.stride(0), pro.inv_freq.shape[0],
                    pro.eps)  # fmt: skip
    else:  # unused without PROLOGUE
        prologue = (q, q, 0, 0, 0, 0, q, q, q, q, q, q, 0, 0, 0.0)
    common = dict(GROUP=group, D=head_dim, PAGE=page_size, MIN_SPLIT=config.min_split)
    decode_attention_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, kv_cache, *indices, o_part, lse_part, out,
        q.stride(0), q.stride(1), *kv_cache.stride()[:4], out.stride(0), out.stride(1),
        scale * 1.4426950408889634,  # log2(e): the softmax runs in base 2
        num_splits, *prologue, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_T=config.block_t,
        DIRECT=num_splits == 1, NUM_STAGES=config.num_stages, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PROLOGUE=pro is not None, PRELOAD=_preload(config.min_split), num_warps=config.num_warps, PDL=pdl, launch_pdl=pdl,
        **({"maxnreg": config.max_registers} if config.max_registers else {}), **common,
    )  # fmt: skip
    if num_splits > 1:
        block_d = _merge_block_d(num_seqs * num_q_heads, head_dim, _device.num_sms(q.device))
        block_s = min(triton.next_power_of_2(num_splits), max(1, _MERGE_TILE // block_d))
        decode_attention_merge_kernel[(num_seqs, num_q_heads, head_dim // block_d)](
            o_part, lse_part, indices[0], indices[2], out, out.stride(0), out.stride(1), num_splits,
            BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, PDL=pdl, launch_pdl=pdl, **common,
        )  # fmt: skip
    return out


def _preload(min_split: int) -> bool:
    """Whether a split of ``min_split`` keys can be one ``tl.dot`` tile (a power of two, at least 16),
    which the one-tile splits then load before ``gdc_wait``."""
    return min_split >= 16 and min_split & (min_split - 1) == 0


def _merge_block_d(num_rows: int, head_dim: int, num_sms: int) -> int:
    """Head-dim columns per merge program: ``head_dim``, or fewer (down to 32) until there are
    about two programs per SM (batch 1 has only Hq rows to merge)."""
    block_d = head_dim
    while block_d > 32 and num_rows * (head_dim // block_d) < 2 * num_sms:
        block_d //= 2
    return block_d
