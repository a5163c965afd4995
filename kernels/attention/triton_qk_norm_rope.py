"""Fused QK RMSNorm + partial RoPE + gate split: Triton version of ``kernels.attention.qk_norm_rope.qk_norm_rope_gate``.

Shapes (as the reference): ``q_gate`` ``[T, Hq, 2D]`` (per head ``| query (D) | gate (D) |``), ``k``
``[T, Hk, D]``, both with a unit last stride; ``q_norm_w``, ``k_norm_w`` ``[D]``; ``positions`` ``[T]``;
``inv_freq`` ``[R // 2]`` fp32. Returns ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hk, D]``, ``gate`` ``[T, Hq * D]``.

Five reference ops in one launch (q norm, k norm, RoPE of q, RoPE of k, the gate copy): program
``(t, h)`` handles query head ``h`` for ``h < Hq`` (and copies its gate) or key head ``h - Hq``. A row
is normalised in fp32, rounded to the input dtype (the reference's ``rms_norm`` output), then
rotated: dim ``j < R`` pairs with ``j +- R/2``, whose normalised value comes from a second load of
the row rather than a register shuffle. cos/sin are computed in fp32 and rounded to the input
dtype, and ``x*cos``, ``rot*sin`` and their sum each round to it, as the reference's eager ops do.

``qk_norm_rope_gate_store`` (the reference of the same name) is the same launch with the key
programs writing their rotated row straight into the paged KV cache at ``slot_mapping`` and
copying the value row beside it (``STORE``): the four launches of the torch ``store_kv`` (page and
offset arithmetic, two index-puts) and the ``k`` round trip through memory are gone.

Memory traffic at the 35B-A3B decode shape (16 q / 2 kv heads of 256, bf16, one token): reads
q_gate 16 KiB + k 1 KiB + weights 1 KiB, writes q 8 KiB + gate 8 KiB + k 1 KiB: ~35 KiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


__all__ = ["qk_norm_rope_gate", "qk_norm_rope_gate_store"]


@triton.jit
def _rope_cos_sin(p_inv_freq, b_pos, HALF, dtype: tl.constexpr, BD: tl.constexpr):
    """``(cos, sin)`` ``[BD]`` fp32 of the dims ``< 2 * HALF`` at position ``b_pos``, each rounded to
    ``dtype`` (the reference's cos/sin tensors), and the mask of those dims."""
    o_d = tl.arange(0, BD)
    m_rot = o_d < 2 * HALF
    b_freq = b_pos * tl.load(p_inv_freq + tl.where(o_d < HALF, o_d, o_d - HALF), mask=m_rot, other=0.0)
    # No fast approximate cos/sin here: tl.cos / tl.sin equal torch.cos / torch.sin bit for bit for
    # angles up to 2.6e5 rad (position 256K at inv_freq 1) on the GPU.
    return tl.cos(b_freq).to(dtype).to(tl.float32), tl.sin(b_freq).to(dtype).to(tl.float32), m_rot


@triton.jit
def _to_cache(b_x, p_dst):
    """``b_x`` (in the input's dtype) as ``p_dst`` stores it: an fp8 page takes the saturating
    cast of the reference (``kernels.attention.reference.store_kv``), other dtypes a plain one."""
    if p_dst.dtype.element_ty == tl.float8e4nv:
        b_x = tl.clamp(b_x.to(tl.float32), -448.0, 448.0)
    return b_x.to(p_dst.dtype.element_ty)


@triton.jit
def _norm_rope_row(p_x, p_w, p_o, p_inv_freq, b_pos, D, HALF, eps, BD: tl.constexpr):
    """Normalise the row at ``p_x`` and rotate its first ``2 * HALF`` dims (rounding as the
    reference does, in the input's dtype); writes ``p_o``."""
    dtype = p_x.dtype.element_ty
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_cos, b_sin, m_rot = _rope_cos_sin(p_inv_freq, b_pos, HALF, dtype, BD)
    o_pair = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    b_x = tl.load(p_x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    b_y = (b_x * b_rstd * (1.0 + b_w)).to(dtype).to(tl.float32)

    b_xp = tl.load(p_x + o_pair, mask=m_rot, other=0.0).to(tl.float32)
    b_wp = tl.load(p_w + o_pair, mask=m_rot, other=0.0).to(tl.float32)
    b_yp = (b_xp * b_rstd * (1.0 + b_wp)).to(dtype).to(tl.float32)
    b_rot = tl.where(o_d < HALF, -b_yp, b_yp)
    b_roped = (b_y * b_cos).to(dtype).to(tl.float32) + (b_rot * b_sin).to(dtype).to(tl.float32)
    tl.store(p_o + o_d, _to_cache(tl.where(m_rot, b_roped, b_y).to(dtype), p_o), mask=m_d)


@triton.jit
def norm_rope_rows(p_x, s_row, m_rows, p_w, p_inv_freq, b_pos, HALF, eps, BR: tl.constexpr, D: tl.constexpr):
    """``_norm_rope_row`` of ``BR`` rows ``s_row`` apart (``D`` a power of two), held in registers:
    ``[BR, D]`` in ``p_x``'s dtype, zeros on the rows outside ``m_rows``. The same rounding as
    ``_norm_rope_row``, with cos/sin computed once for all rows (they depend on the position alone).
    The decode attention's fused prologue (``kernels.attention.triton_decode``) normalises and
    rotates its query heads with it."""
    dtype = p_x.dtype.element_ty
    o_d = tl.arange(0, D)
    o_pair = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    p_rows = p_x + tl.arange(0, BR)[:, None] * s_row
    m_2 = m_rows[:, None] & (o_d < D)[None, :]
    b_cos, b_sin, m_rot = _rope_cos_sin(p_inv_freq, b_pos, HALF, dtype, D)
    b_x = tl.load(p_rows + o_d[None, :], mask=m_2, other=0.0).to(tl.float32)
    b_xp = tl.load(p_rows + o_pair[None, :], mask=m_2 & m_rot[None, :], other=0.0).to(tl.float32)
    b_w = tl.load(p_w + o_d).to(tl.float32)
    b_wp = tl.load(p_w + o_pair, mask=m_rot, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]
    b_y = (b_x * b_rstd * (1.0 + b_w[None, :])).to(dtype).to(tl.float32)
    b_yp = (b_xp * b_rstd * (1.0 + b_wp[None, :])).to(dtype).to(tl.float32)
    b_rot = tl.where((o_d < HALF)[None, :], -b_yp, b_yp)
    b_roped = (b_y * b_cos[None, :]).to(dtype).to(tl.float32) + (b_rot * b_sin[None, :]).to(dtype).to(tl.float32)
    return tl.where(m_rot[None, :], b_roped, b_y).to(dtype)


@triton.jit
def norm_rope_store_kv(p_k, p_v, p_w, p_inv_freq, b_pos, i_slot, kv, s_cp, s_c2, s_co, s_ch, i_hk, PAGE, D, HALF, eps,
                       BD: tl.constexpr):  # fmt: skip
    """Key head ``i_hk`` of one token normalised and rotated (``p_k``), and its value row (``p_v``),
    into their page of ``kv`` at ``i_slot`` (int64): K plane 0, V plane 1 (NHD layout)."""
    p_dst = kv + (i_slot // PAGE) * s_cp + (i_slot % PAGE) * s_co + i_hk * s_ch
    _norm_rope_row(p_k, p_w, p_dst, p_inv_freq, b_pos, D, HALF, eps, BD)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_v = tl.load(p_v + o_d, mask=m_d)
    tl.store(p_dst + s_c2 + o_d, _to_cache(b_v, p_dst), mask=m_d)


@triton.jit
def qk_norm_rope_gate_kernel(
    q_gate,
    k,
    q_norm_w,
    k_norm_w,
    positions,
    inv_freq,
    o_q,
    o_k,
    o_gate,
    v,
    slots,
    kv,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_cp,
    s_c2,
    s_co,
    s_ch,
    PAGE,
    HQ,
    HK,
    D,
    HALF,
    eps,
    BD: tl.constexpr,
    STORE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    b_pos = tl.load(positions + i_t).to(tl.float32)
    if i_h < HQ:
        p_row = q_gate + i_t * s_qt + i_h * s_qh
        _norm_rope_row(p_row, q_norm_w, o_q + (i_t * HQ + i_h) * D, inv_freq, b_pos, D, HALF, eps, BD)
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        tl.store(o_gate + (i_t * HQ + i_h) * D + o_d, tl.load(p_row + D + o_d, mask=m_d), mask=m_d)
    else:
        i_hk = i_h - HQ
        p_row = k + i_t * s_kt + i_hk * s_kh
        if STORE:
            i_slot = tl.load(slots + i_t).to(tl.int64)
            norm_rope_store_kv(p_row, v + i_t * s_vt + i_hk * s_vh, k_norm_w, inv_freq, b_pos, i_slot, kv,
                               s_cp, s_c2, s_co, s_ch, i_hk, PAGE, D, HALF, eps, BD)  # fmt: skip
        else:
            _norm_rope_row(p_row, k_norm_w, o_k + (i_t * HK + i_hk) * D, inv_freq, b_pos, D, HALF, eps, BD)


def _check_shapes(q_gate: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor) -> None:
    num_tokens, _, width = q_gate.shape
    head_dim = k.shape[-1]
    if width != 2 * head_dim or k.shape[0] != num_tokens or q_gate.dtype != k.dtype:
        raise ValueError(
            f"q_gate must be [T, Hq, 2D] and k [T, Hk, D] of one dtype, "
            f"got {tuple(q_gate.shape)} {q_gate.dtype} and {tuple(k.shape)} {k.dtype}"
        )
    if 2 * inv_freq.shape[0] > head_dim:
        raise ValueError(f"rotary dims 2 * {inv_freq.shape[0]} exceed head_dim {head_dim}")


def qk_norm_rope_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [T, Hq, D], k [T, Hk, D], gate [T, Hq * D])``, see the module docstring."""
    _check_shapes(q_gate, k, inv_freq)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q, gate = _launch(q_gate, k, q_norm_w, k_norm_w, positions, inv_freq, eps, k_out, None, pdl)
    return q, k_out, gate


def qk_norm_rope_gate_store(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, Hq, D], gate [T, Hq * D])``; rotated ``k`` and ``v`` land in ``kv_cache`` at ``slot_mapping``."""
    _check_shapes(q_gate, k, inv_freq)
    if v.shape != k.shape or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != k.shape[1:] or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"v must be shaped like k {tuple(k.shape)} and kv_cache [pages, 2, page_size, Hk, D] with a unit "
            f"last stride, got v {tuple(v.shape)} and kv_cache {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    return _launch(q_gate, k, q_norm_w, k_norm_w, positions, inv_freq, eps, None, (v, kv_cache, slot_mapping), pdl)


def _launch(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor,
    k_norm_w: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    k_out: torch.Tensor | None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over ``(token, q head | k head)``: ``k`` to ``k_out``, or with ``store`` to the cache."""
    num_tokens, num_q_heads, _ = q_gate.shape
    num_k_heads, head_dim = k.shape[1:]
    q_gate, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_gate, k))
    q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q_gate.dtype, device=q_gate.device)
    gate = torch.empty((num_tokens, num_q_heads * head_dim), dtype=q_gate.dtype, device=q_gate.device)
    if num_tokens == 0:
        return q, gate
    if store is None:
        assert k_out is not None
        v, kv, slots = k, k_out, positions  # unused by the kernel without STORE
        cache = (0, 0, 0, 0, 1)
    else:
        v, kv, slots = store
        v = v if v.stride(-1) == 1 else v.contiguous()
        k_out = kv
        cache = (*kv.stride()[:4], kv.shape[2])  # page, K/V, offset, head strides; page size
    qk_norm_rope_gate_kernel[(num_tokens, num_q_heads + num_k_heads)](
        q_gate, k, q_norm_w.contiguous(), k_norm_w.contiguous(), positions, inv_freq.float().contiguous(),
        q, k_out, gate, v, slots, kv,
        q_gate.stride(0), q_gate.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache,
        num_q_heads, num_k_heads, head_dim, inv_freq.shape[0], eps,
        BD=triton.next_power_of_2(head_dim), STORE=store is not None, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return q, gate
