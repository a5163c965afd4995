"""The split-KV decode attention's two kernels: the split launch (with its optional prologue and
one-tile preload) and the merge. ``kernels.attention.triton_decode`` launches them and documents
the shapes, the split rule and why.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from phloem.kernels.attention.triton_qk_norm_rope import norm_rope_rows, norm_rope_store_kv

__all__ = ["decode_attention_merge_kernel", "decode_attention_split_kernel"]


@triton.jit
def _seq_split(kv_indptr, kv_last_page_len, i_b, num_splits, PAGE: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """``(first kv_indices slot, seq_len, split_len, num_active)`` of sequence ``i_b``; both kernels
    call this, so they agree on which workspace rows exist."""
    i_first = tl.load(kv_indptr + i_b)
    num_pages = tl.load(kv_indptr + i_b + 1) - i_first
    seq_len = tl.maximum((num_pages - 1) * PAGE + tl.load(kv_last_page_len + i_b), 0)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), MIN_SPLIT) * MIN_SPLIT, MIN_SPLIT)
    return i_first.to(tl.int64), seq_len, split_len, tl.cdiv(seq_len, split_len)


@triton.jit
def _kv_tile(p_kv, kv_indices, i_first, t, t_end, o_t, s_cp, s_ct, s_ckv, PAGE: tl.constexpr):
    """K and V ``[BLOCK_T, D]`` of positions ``t + o_t`` below ``t_end`` (each through its page id),
    and that mask; masked rows read as 0 (unwritten slots of the last page may hold anything, NaN)."""
    o_pos = t + o_t
    m_t = o_pos < t_end
    i_page = tl.load(kv_indices + i_first + o_pos // PAGE, mask=m_t, other=0).to(tl.int64)
    o_kv = i_page[:, None] * s_cp + (o_pos % PAGE)[:, None] * s_ct  # [BLOCK_T, 1] int64
    b_k = tl.load(p_kv + o_kv, mask=m_t[:, None], other=0.0)
    b_v = tl.load(p_kv + s_ckv + o_kv, mask=m_t[:, None], other=0.0)
    return b_k, b_v, m_t


@triton.jit
def _attend_tile(b_q, b_k, b_v, m_t, b_m, b_l, b_acc, qk_scale, PRECISION: tl.constexpr):
    """One tile of keys into the online softmax (base 2): the new ``(max, sum, accumulator)``."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_T]
    b_s = tl.where(m_t[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_m_new, b_l, b_acc * b_alpha[:, None] + b_pv


@triton.jit
def decode_attention_split_kernel(
    q,
    kv_cache,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    o_part,
    lse_part,
    out,
    s_qb,
    s_qh,
    s_cp,
    s_ckv,
    s_ct,
    s_ch,
    s_ob,
    s_oh,
    qk_scale,
    num_splits,
    k_new,
    v_new,
    s_kb,
    s_kh,
    s_vb,
    s_vh,
    q_norm_w,
    k_norm_w,
    positions,
    inv_freq,
    slots,
    gate,
    s_gb,
    half,
    eps,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DIRECT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
    PROLOGUE: tl.constexpr,
    PRELOAD: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    # Split slowest: the busy programs of short sequences (low splits) are dispatched first.
    i_hk = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    num_kv_heads = tl.num_programs(0).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < GROUP
    o_d = tl.arange(0, D)
    # The page lists are step inputs (copied in before the step's first kernel): read before the
    # wait, so the programs past a short sequence's splits end without waiting for anything.
    i_first, seq_len, split_len, num_active = _seq_split(kv_indptr, kv_last_page_len, i_b, num_splits, PAGE, MIN_SPLIT)
    if i_s < num_active:
        t_start = i_s * split_len
        t_end = tl.minimum(t_start + split_len, seq_len)
        o_t = tl.arange(0, BLOCK_T)
        p_kv = kv_cache + i_hk * s_ch + o_d[None, :]
        if PRELOAD:
            # A split of one MIN_SPLIT tile (every split of a short sequence) loads it before the
            # wait, all but the step's own key (position seq_len - 1): no kernel of this step writes
            # the others, so their loads overlap the kernels before. Longer splits walk as below.
            o_ts = tl.arange(0, MIN_SPLIT)
            one_tile = split_len <= MIN_SPLIT
            b_k0 = tl.zeros([MIN_SPLIT, D], dtype=kv_cache.dtype.element_ty)
            b_v0 = tl.zeros([MIN_SPLIT, D], dtype=kv_cache.dtype.element_ty)
            m_t0 = o_ts < 0
            if one_tile:
                b_k0, b_v0, m_t0 = _kv_tile(p_kv, kv_indices, i_first, t_start, tl.minimum(t_end, seq_len - 1), o_ts,
                                            s_cp, s_ct, s_ckv, PAGE)  # fmt: skip
        if PDL:
            gdc_wait()  # q and this step's K/V row come from the kernel before (kernels/common/pdl.py)
        if PROLOGUE:
            # q is the projection's | query | gate | per head: this program normalises and rotates
            # its query heads itself; split 0 copies their gates out, and the last split (the one
            # holding the step's own key) writes this KV head's new K and V row into its page, then
            # reads it back like any key (its own writes, visible to all its threads after the barrier).
            b_pos = tl.load(positions + i_b).to(tl.float32)
            p_qg = q + i_b * s_qb + (i_hk * GROUP) * s_qh
            b_q = norm_rope_rows(p_qg, s_qh, m_g, q_norm_w, inv_freq, b_pos, half, eps, BLOCK_G, D)  # [BLOCK_G, D]
            if i_s == 0:
                p_g = p_qg + o_g[:, None] * s_qh + D + o_d[None, :]
                p_gate = gate + i_b * s_gb + (i_hk * GROUP + o_g[:, None]) * D + o_d[None, :]
                tl.store(p_gate, tl.load(p_g, mask=m_g[:, None]), mask=m_g[:, None])
            if i_s == num_active - 1:
                i_slot = tl.load(slots + i_b).to(tl.int64)
                norm_rope_store_kv(k_new + i_b * s_kb + i_hk * s_kh, v_new + i_b * s_vb + i_hk * s_vh, k_norm_w,
                                   inv_freq, b_pos, i_slot, kv_cache, s_cp, s_ckv, s_ct, s_ch, i_hk, PAGE, D, half,
                                   eps, D)  # fmt: skip
                tl.debug_barrier()
        else:
            p_q = q + i_b * s_qb + (i_hk * GROUP + o_g[:, None]) * s_qh + o_d[None, :]
            b_q = tl.load(p_q, mask=m_g[:, None], other=0.0)  # [BLOCK_G, D]
        b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_G], tl.float32)
        b_acc = tl.zeros([BLOCK_G, D], tl.float32)
        t_loop = t_start
        if PRELOAD:
            if one_tile:
                # The step's key is in this split: the tile again, after its write.
                if seq_len - 1 < t_end:
                    b_k0, b_v0, m_t0 = _kv_tile(p_kv, kv_indices, i_first, t_start, t_end, o_ts, s_cp, s_ct, s_ckv, PAGE)
                b_m, b_l, b_acc = _attend_tile(b_q, b_k0, b_v0, m_t0, b_m, b_l, b_acc, qk_scale, PRECISION)
                t_loop = t_end
        for t in tl.range(t_loop, t_end, BLOCK_T, num_stages=NUM_STAGES):
            b_k, b_v, m_t = _kv_tile(p_kv, kv_indices, i_first, t, t_end, o_t, s_cp, s_ct, s_ckv, PAGE)
            b_m, b_l, b_acc = _attend_tile(b_q, b_k, b_v, m_t, b_m, b_l, b_acc, qk_scale, PRECISION)
        # Every active split has a key, and the zero padding rows score 0: b_l >= 1 on every row.
        b_o = b_acc / b_l[:, None]
        if DIRECT:
            p_out = out + i_b * s_ob + (i_hk * GROUP + o_g[:, None]) * s_oh + o_d[None, :]
            tl.store(p_out, b_o.to(out.dtype.element_ty), mask=m_g[:, None])
        else:
            i_row = ((i_b * num_kv_heads + i_hk) * num_splits + i_s) * GROUP
            tl.store(o_part + (i_row + o_g[:, None]) * D + o_d[None, :], b_o, mask=m_g[:, None])
            tl.store(lse_part + i_row + o_g, b_m + tl.log2(b_l), mask=m_g)


@triton.jit
def decode_attention_merge_kernel(
    o_part,
    lse_part,
    kv_indptr,
    kv_last_page_len,
    out,
    s_ob,
    s_oh,
    num_splits,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the split kernel's partials first (kernels/common/pdl.py)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    i_d = tl.program_id(2)
    num_kv_heads = tl.num_programs(1).to(tl.int64) // GROUP
    _, _, _, num_active = _seq_split(kv_indptr, kv_last_page_len, i_b, num_splits, PAGE, MIN_SPLIT)
    # Row of split 0 for this query head; split s is GROUP rows further.
    i_row = (i_b * num_kv_heads + i_h // GROUP) * num_splits * GROUP + i_h % GROUP
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_s = tl.arange(0, BLOCK_S)
    b_m = tl.full([], float("-inf"), tl.float32)
    b_l = tl.zeros([], tl.float32)
    b_acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, num_active, BLOCK_S):
        m_s = s + o_s < num_active
        o_row = i_row + (s + o_s) * GROUP
        b_lse = tl.load(lse_part + o_row, mask=m_s, other=float("-inf"))  # [BLOCK_S]
        b_o = tl.load(o_part + o_row[:, None] * D + o_d[None, :], mask=m_s[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
        b_m_new = tl.maximum(b_m, tl.max(b_lse, 0))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_w = tl.exp2(b_lse - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_w, 0)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_o, 0)
        b_m = b_m_new
    b_out = tl.where(b_l > 0, b_acc / b_l, 0.0)
    tl.store(out + i_b * s_ob + i_h * s_oh + o_d, b_out.to(out.dtype.element_ty))
