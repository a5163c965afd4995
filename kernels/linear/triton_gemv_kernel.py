"""The one-token GEMV kernel and its prologue / epilogue helpers (``kernels.linear.triton_gemv`` launches
it and describes its modes: ``PRO``, ``CONV``, ``ROUTE``).

Notation: ``p_`` pointers, ``o_`` offsets, ``m_`` masks, ``b_`` tiles; ``i_p`` the program, ``n_p``
the programs. A program walks row blocks ``i_p, i_p + n_p, ...`` of ``BLOCK_N`` rows.

With ``FP8`` the weight is ``float8_e4m3fn`` ``[N, K]`` with fp32 scales ``[N, ceil(K / 128)]``
(``kernels.linear.fp8.Fp8Weight``): a block's tile is loaded as a dense one's, ``[BLOCK_N, KP]``, with
its scales ``[BLOCK_N, KP // KS]`` (``KS = min(KP, 128)`` columns a scale); the fp32 products with
``x̂`` are summed per ``KS`` columns, each sum multiplied once by its scale (the dequantized
weight's dot product, one multiply per scale instead of one per element), then summed. Summed
from the ``[BLOCK_N, KP]`` product the tile keeps the dense layout, which holds fewer registers
than a ``[BLOCK_N, KP // KS, KS]`` tile (``docs/decisions.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["gemv_kernel"]


@triton.jit
def _gemv_input(
    p_x, p_a, p_nw, p_res, p_normed, K, eps, i_p,
    PRO: tl.constexpr, HAS_A: tl.constexpr, WRITE_NORMED: tl.constexpr, ROUND_WEIGHTED: tl.constexpr,
    HEAD: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    """``x̂`` ``[KP]`` fp32 (zeros past ``K``); see the module docstring for the modes."""
    dtype = p_x.dtype.element_ty
    o_k = tl.arange(0, KP)
    m_k = o_k < K
    if PRO == 2:  # PRO_GATED_RMS_NORM: heads of HEAD values, each normalised on its own
        NH: tl.constexpr = KP // HEAD
        o_2 = tl.arange(0, NH)[:, None] * HEAD + tl.arange(0, HEAD)[None, :]
        m_2 = o_2 < K
        b_v = tl.load(p_x + o_2, mask=m_2, other=0.0).to(tl.float32)
        b_g = tl.load(p_a + o_2, mask=m_2, other=0.0).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_v * b_v, axis=1) / HEAD + eps)
        b_nw = tl.load(p_nw + tl.arange(0, HEAD)).to(tl.float32)
        b_n = b_nw[None, :] * (b_v * b_rstd[:, None]).to(dtype).to(tl.float32)
        if ROUND_WEIGHTED:
            b_n = b_n.to(dtype).to(tl.float32)
        b_n = (b_n * (b_g / (1.0 + tl.exp(-b_g)))).to(dtype).to(tl.float32)
        return tl.reshape(b_n, (KP,))
    b_x = tl.load(p_x + o_k, mask=m_k, other=0.0).to(tl.float32)
    if PRO == 1:  # PRO_ADD_RMS_NORM
        if HAS_A:
            b_x = (b_x + tl.load(p_a + o_k, mask=m_k, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / K + eps)
        b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_n = (b_x * b_rstd * (1.0 + b_nw)).to(dtype).to(tl.float32)
        if i_p == 0:
            if HAS_A:
                tl.store(p_res + o_k, b_x.to(dtype), mask=m_k)
            if WRITE_NORMED:
                tl.store(p_normed + o_k, b_n.to(dtype), mask=m_k)
        return b_n
    if PRO == 3:  # PRO_SIGMOID_GATE
        b_g = tl.load(p_a + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_x = (b_x * tl.sigmoid(b_g).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return b_x


@triton.jit
def _conv_operands(o_n, N, p_cw, p_cs, i_read, s_cw, s_cn, s_cd, CONV_N, KC: tl.constexpr, BKC: tl.constexpr):
    """The conv state (window columns ``0..KC-2``, and ``1..KC-2`` shifted to the front) and weights
    of rows ``o_n``; zeros past ``CONV_N``."""
    dtype = p_cs.dtype.element_ty
    o_c = tl.arange(0, BKC)
    m_c = (o_n < N) & (o_n < CONV_N)
    p_read = p_cs + i_read * s_cn + o_n[:, None] * s_cd + o_c[None, :]
    b_s = tl.load(p_read, mask=m_c[:, None] & (o_c[None, :] < KC - 1), other=0.0).to(dtype)
    b_next = tl.load(p_read + 1, mask=m_c[:, None] & (o_c[None, :] < KC - 2), other=0.0).to(dtype)
    b_cw = tl.load(p_cw + o_n[:, None] * s_cw + o_c[None, :], mask=m_c[:, None] & (o_c[None, :] < KC), other=0.0)
    return b_s, b_next, b_cw


@triton.jit
def _conv_epilogue(
    b_y, o_n, m_n, b_s, b_next, b_cw, p_y, p_cs, i_write, s_cn, s_cd, CONV_N,
    KC: tl.constexpr, BKC: tl.constexpr, BARRIER: tl.constexpr,
):  # fmt: skip
    """Rows ``< CONV_N`` of ``b_y`` (the block's projection, rounded) through the conv update
    (``kernels.gdn.triton_conv1d``'s rounding), the state shifted into the write slot."""
    dtype = p_y.dtype.element_ty
    w_dtype = b_cw.dtype
    o_c = tl.arange(0, BKC)
    m_s = (m_n & (o_n < CONV_N))[:, None] & (o_c[None, :] < KC - 1)
    b_win = tl.where(o_c[None, :] == KC - 1, b_y[:, None], b_s.to(dtype))
    b_acc = tl.sum(b_win.to(w_dtype).to(tl.float32) * b_cw.to(tl.float32), 1).to(w_dtype).to(tl.float32)
    b_conv = (b_acc / (1.0 + tl.exp(-b_acc))).to(w_dtype).to(dtype)
    tl.store(p_y + o_n, tl.where(o_n < CONV_N, b_conv, b_y), mask=m_n)
    b_new = tl.where(o_c[None, :] == KC - 2, b_y[:, None], b_next.to(dtype))
    if BARRIER:  # every thread has loaded its part of the state before any shifts it in place
        tl.debug_barrier()
    tl.store(p_cs + i_write * s_cn + o_n[:, None] * s_cd + o_c[None, :], b_new.to(p_cs.dtype.element_ty), mask=m_s)


@triton.jit
def _route_tile(p_rt, o_n, N, o_e, m_e, E1):
    """The transposed router's rows ``o_n`` ``[BLOCK_N, BE]`` (zeros past ``N`` and ``E1``)."""
    return tl.load(p_rt + o_n[:, None].to(tl.int64) * E1 + o_e[None, :], mask=(o_n < N)[:, None] & m_e[None, :], other=0.0)


@triton.jit
def _weight_tile(p_w, p_ws, o_n, N, K, s_wn, s_sn, FP8: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr):
    """Rows ``o_n`` of the weight, zeros past ``N`` and ``K``: ``(tile [BLOCK_N, KP], 0.0)``, or with
    ``FP8`` ``(e4m3 tile [BLOCK_N, KP], scales [BLOCK_N, KP // KS])`` (a tile narrower than 128
    columns, ``KP < 128``, is one scale block)."""
    m_n = o_n < N
    o_k = tl.arange(0, KP)
    b_w = tl.load(p_w + o_n[:, None].to(tl.int64) * s_wn + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :],
                  other=0.0)  # fmt: skip
    if FP8:
        o_s = tl.arange(0, KP // KS)
        b_s = tl.load(p_ws + o_n[:, None].to(tl.int64) * s_sn + o_s[None, :],
                      mask=m_n[:, None] & (o_s * KS < K)[None, :], other=0.0)  # fmt: skip
    else:
        b_s = 0.0
    return b_w, b_s


@triton.jit
def _tile_dot(b_w, b_s, b_x, FP8: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr):
    """``[BLOCK_N]`` fp32: the tile's rows times ``b_x`` ``[KP]`` (with ``FP8``, each ``KS``-column
    partial sum times its scale)."""
    if FP8:
        b_part = tl.sum(tl.reshape(b_w.to(tl.float32) * b_x[None, :], (BLOCK_N, KP // KS, KS)), axis=2)  # [BLOCK_N, KP // KS]
        b_y = tl.sum(b_part * b_s, axis=1)
    else:
        b_y = tl.sum(b_w.to(tl.float32) * b_x[None, :], axis=1)
    return b_y


@triton.jit
def gemv_kernel(
    p_x, p_w, p_y, N, K, s_wn, p_ws, s_sn,
    p_a, p_nw, p_res, p_normed, eps,
    p_cw, p_cs, p_read, p_write, s_cw, s_cn, s_cd, CONV_N,
    p_h, p_rt, p_pw, p_acc, E1, scale,
    PRO: tl.constexpr, CONV: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_A: tl.constexpr, WRITE_NORMED: tl.constexpr, ROUND_WEIGHTED: tl.constexpr, HEAD: tl.constexpr,
    KC: tl.constexpr, BKC: tl.constexpr, CONV_BLOCKS: tl.constexpr,
    ROUTE: tl.constexpr, BE: tl.constexpr, COPIES: tl.constexpr, PDL: tl.constexpr,
    FP8: tl.constexpr, KS: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_b = tl.arange(0, BLOCK_N)
    o_first = i_p * BLOCK_N + o_b
    if ROUTE:
        o_e = tl.arange(0, BE)
        m_e = o_e < E1
        b_route = tl.zeros([BE], dtype=tl.float32)
        if PREFETCH:  # the router's rows and norm weights of the first block, before the wait
            b_rt = _route_tile(p_rt, o_first, N, o_e, m_e, E1)
            b_pw = tl.load(p_pw + o_first, mask=o_first < N, other=0.0)
    if PREFETCH:
        b_w, b_ws = _weight_tile(p_w, p_ws, o_first, N, K, s_wn, s_sn, FP8, KP, KS)
    if CONV:
        # Step inputs (copied in before the step) and the layer's own conv state: no kernel before
        # this one in the step writes them.
        i_read = tl.load(p_read).to(tl.int64)
        i_write = tl.load(p_write).to(tl.int64)
        if CONV_BLOCKS > 0:
            # The conv operands of all this program's blocks (at most CONV_BLOCKS), before the wait:
            # loaded block by block they put a memory latency into every step of the walk.
            o_j = tl.arange(0, CONV_BLOCKS)
            o_rows = tl.reshape((i_p + o_j * n_p)[:, None] * BLOCK_N + o_b[None, :], (CONV_BLOCKS * BLOCK_N,))
            b_s3, b_next3, b_cw3 = _conv_operands(o_rows, N, p_cw, p_cs, i_read, s_cw, s_cn, s_cd, CONV_N, KC, BKC)
            # Every thread has loaded its part of the state before any shifts it in place.
            tl.debug_barrier()
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    if ROUTE:  # the residual of the first block's rows, issued with the prologue's loads
        b_h = tl.load(p_h + o_first, mask=o_first < N, other=0.0)
    b_x = _gemv_input(p_x, p_a, p_nw, p_res, p_normed, K, eps, i_p, PRO, HAS_A, WRITE_NORMED, ROUND_WEIGHTED, HEAD, KP)
    if CONV_BLOCKS > 0:
        b_kept = tl.zeros([CONV_BLOCKS, BLOCK_N], dtype=p_y.dtype.element_ty)
    for i_blk in range(i_p, tl.cdiv(N, BLOCK_N), n_p):
        o_n = i_blk * BLOCK_N + o_b
        m_n = o_n < N
        if PREFETCH:
            # The next block's tile is in flight while this block is reduced.
            o_next = o_n + n_p * BLOCK_N
            b_cur, b_curs = b_w, b_ws
            b_w, b_ws = _weight_tile(p_w, p_ws, o_next, N, K, s_wn, s_sn, FP8, KP, KS)
        else:
            b_cur, b_curs = _weight_tile(p_w, p_ws, o_n, N, K, s_wn, s_sn, FP8, KP, KS)
        if ROUTE:
            b_hc = b_h
            b_h = tl.load(p_h + o_n + n_p * BLOCK_N, mask=o_n + n_p * BLOCK_N < N, other=0.0)
            if PREFETCH:
                b_rtc, b_pwc = b_rt, b_pw
                b_rt = _route_tile(p_rt, o_n + n_p * BLOCK_N, N, o_e, m_e, E1)
                b_pw = tl.load(p_pw + o_n + n_p * BLOCK_N, mask=o_n + n_p * BLOCK_N < N, other=0.0)
            else:
                b_rtc = _route_tile(p_rt, o_n, N, o_e, m_e, E1)
                b_pwc = tl.load(p_pw + o_n, mask=m_n, other=0.0)
        if CONV and CONV_BLOCKS == 0:
            # Loaded in the block's own step (with the next tile they would hold too many registers).
            b_s, b_next, b_cw = _conv_operands(o_n, N, p_cw, p_cs, i_read, s_cw, s_cn, s_cd, CONV_N, KC, BKC)
        b_y = _tile_dot(b_cur, b_curs, b_x, FP8, BLOCK_N, KP, KS).to(p_y.dtype.element_ty)
        if CONV and CONV_BLOCKS == 0:
            _conv_epilogue(b_y, o_n, m_n, b_s, b_next, b_cw, p_y, p_cs, i_write, s_cn, s_cd, CONV_N, KC, BKC, True)
        elif ROUTE:
            # The residual sum s of these rows (stored in place of y) and their router terms.
            b_s = (b_y.to(tl.float32) + b_hc.to(tl.float32)).to(p_y.dtype.element_ty)
            tl.store(p_y + o_n, b_s, mask=m_n)
            b_route += tl.sum(b_rtc.to(tl.float32) * (b_s.to(tl.float32) * (1.0 + b_pwc.to(tl.float32)))[:, None], axis=0)
        elif CONV:
            # A conv row's projection is kept for the update after the walk, which stores its only
            # value (a store here too would race that one: another thread, no barrier between).
            tl.store(p_y + o_n, b_y, mask=m_n & (o_n >= CONV_N))
            b_kept = tl.where(o_j[:, None] == (i_blk - i_p) // n_p, b_y[None, :], b_kept)
        else:
            tl.store(p_y + o_n, b_y, mask=m_n)
    if ROUTE:
        # This program's terms in fixed point (kernels/moe/route_partial.py): integer sums, the same
        # bits whatever order the programs add in.
        p_row = p_acc + (i_p % COPIES) * E1
        tl.atomic_add(p_row + o_e, (b_route * scale).to(tl.int64), mask=m_e, sem="relaxed")
    if CONV_BLOCKS > 0:
        # The conv update after the walk from the projections kept in registers: no barrier and no
        # read back of this program's stores.
        m_rows = (o_rows < N) & (o_rows < CONV_N)
        b_y = tl.reshape(b_kept, (CONV_BLOCKS * BLOCK_N,))
        _conv_epilogue(b_y, o_rows, m_rows, b_s3, b_next3, b_cw3, p_y, p_cs, i_write, s_cn, s_cd, CONV_N, KC, BKC, False)
