"""Depthwise causal conv1d + SiLU over varlen sequences: Triton version of
``kernels.gdn.conv1d.causal_conv1d_varlen`` (prefill and mixed steps).

Shapes (as the reference): ``x`` ``[T, D]`` with unit last stride (the tokens of B sequences,
sequence ``i`` at rows ``query_start_loc[i] : query_start_loc[i+1]``), ``weight`` ``[D, K]``,
``bias`` ``[D] | None``, ``conv_states`` ``[num_slots, D, K-1]`` with unit last stride,
``query_start_loc`` ``[B+1]``, ``read_slots`` / ``write_slots`` ``[B]``, ``has_initial_state``
``[B]`` bool. Returns ``[T, D]`` in ``x.dtype``.

Two launches and a scatter, none of which waits for the host:

1. **Outputs**, one program per (block of ``BT`` tokens, block of ``BD`` channels), tokens of any
   sequences: each token finds its sequence by a binary search of ``query_start_loc``, and tap
   ``j`` of its window reads input position ``p - (K-1) + j`` of its sequence:
   ``x`` where that is ≥ 0, else the sequence's initial state column (zero without one)::

       window of token p:  | state[K-1+q] for q < 0 ... | x[start + q] for q >= 0 |   (q = p-K+1 .. p)

2. **New states**, one program per (sequence, block of channels): the last ``K-1`` inputs of the
   sequence's window (state columns where the sequence is shorter than ``K-1``) into a buffer.
3. ``conv_states[write_slots] = buffer``: every read of the old states happened in 1 and 2, so as
   in the reference a slot read by one sequence may be written by another.

The reference loops over sequences in Python and reads ``query_start_loc`` and each write slot on
the host (a device sync per sequence and layer); in a mixed step (one prefill chunk beside a
decode batch) that loop was most of the GDN layers' host time.

Rounding follows the reference: the state is rounded to ``x.dtype`` on the way in, the window to
``weight.dtype`` for the conv (accumulated in fp32, rounded to ``weight.dtype``), SiLU in fp32
rounded to ``weight.dtype``, then the output to ``x.dtype``; new states go through ``x.dtype``
into ``conv_states.dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from phloem.kernels.gdn.triton_conv1d import conv_operands

__all__ = ["causal_conv1d_varlen"]

_BT = 32
_MAX_BD = 128


@triton.jit(do_not_specialize=["T", "B", "SEARCH_STEPS"])
def _conv_varlen_kernel(
    x, weight, bias, conv_states, query_start_loc, read_slots, has_initial_state, o,
    s_xt, s_wd, s_sn, s_sd, T, D, B, SEARCH_STEPS,
    K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    x_dtype = x.dtype.element_ty
    w_dtype = weight.dtype.element_ty

    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    # The sequence of each token: the last one starting at or before it (a binary search over
    # query_start_loc, SEARCH_STEPS = bit length of B halvings; the step's batch size is a runtime
    # value, so a new batch size compiles nothing).
    lo = tl.zeros((BT,), dtype=tl.int32)
    hi = tl.zeros((BT,), dtype=tl.int32) + (B - 1)
    for _ in range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        start_mid = tl.load(query_start_loc + mid, mask=m_t & active, other=0).to(tl.int64)
        right = start_mid <= o_t
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & ~right, mid - 1, hi)
    i_seq = lo
    b_start = tl.load(query_start_loc + i_seq, mask=m_t, other=0).to(tl.int64)
    b_slot = tl.load(read_slots + i_seq, mask=m_t, other=0).to(tl.int64)
    b_has = tl.load(has_initial_state + i_seq, mask=m_t, other=0) != 0
    p = o_t - b_start  # position of each token in its sequence

    m = m_t[:, None] & m_d[None, :]
    b_acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(K):
        q = p - (K - 1) + j  # input position of tap j
        in_x = q >= 0
        b_x = tl.load(x + (b_start + q)[:, None] * s_xt + o_d[None, :], mask=m & in_x[:, None], other=0.0)
        p_s = conv_states + b_slot[:, None] * s_sn + o_d[None, :] * s_sd + (K - 1 + q)[:, None]
        b_s = tl.load(p_s, mask=m & (~in_x & b_has)[:, None], other=0.0).to(x_dtype)
        b_in = tl.where(in_x[:, None], b_x, b_s)
        b_w = tl.load(weight + o_d * s_wd + j, mask=m_d, other=0.0)
        b_acc += b_in.to(w_dtype).to(tl.float32) * b_w.to(tl.float32)[None, :]
    if HAS_BIAS:
        b_acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    b_acc = b_acc.to(w_dtype).to(tl.float32)
    b_out = (b_acc / (1.0 + tl.exp(-b_acc))).to(w_dtype)
    tl.store(o + o_t[:, None] * D + o_d[None, :], b_out.to(o.dtype.element_ty), mask=m)


@triton.jit
def _final_state_kernel(
    x, conv_states, query_start_loc, read_slots, has_initial_state, new_states,
    s_xt, s_sn, s_sd, D,
    K: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    x_dtype = x.dtype.element_ty

    o_d = i_d * BD + tl.arange(0, BD)
    o_k = tl.arange(0, BK)  # state columns
    m_d = o_d < D
    m = m_d[:, None] & (o_k[None, :] < K - 1)
    start = tl.load(query_start_loc + i_b).to(tl.int64)
    length = tl.load(query_start_loc + i_b + 1).to(tl.int64) - start
    slot = tl.load(read_slots + i_b).to(tl.int64)
    has = tl.load(has_initial_state + i_b) != 0
    q = length - (K - 1) + o_k  # input position of state column k
    in_x = q >= 0
    b_x = tl.load(x + (start + q)[None, :] * s_xt + o_d[:, None], mask=m & in_x[None, :], other=0.0)
    p_s = conv_states + slot * s_sn + o_d[:, None] * s_sd + (K - 1 + q)[None, :]
    b_s = tl.load(p_s, mask=m & (~in_x[None, :] & has), other=0.0).to(x_dtype)
    b_new = tl.where(in_x[None, :], b_x, b_s)
    tl.store(new_states + i_b * D * (K - 1) + o_d[:, None] * (K - 1) + o_k[None, :],
             b_new.to(new_states.dtype.element_ty), mask=m)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    num_tokens, dim = x.shape
    kernel_size = weight.shape[1]
    num_seqs = read_slots.shape[0]
    x, weight, bias = conv_operands(x, weight, bias, conv_states)
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    has_initial_state = has_initial_state.to(device=x.device)
    block_d = min(triton.next_power_of_2(dim), _MAX_BD)
    _conv_varlen_kernel[(triton.cdiv(num_tokens, _BT), triton.cdiv(dim, block_d))](
        x, weight, bias, conv_states, query_start_loc, read_slots, has_initial_state, out,
        x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1), num_tokens, dim, num_seqs,
        max(1, num_seqs.bit_length()), K=kernel_size, BT=_BT, BD=block_d, HAS_BIAS=bias is not None,
    )  # fmt: skip
    new_states = torch.empty((num_seqs, dim, kernel_size - 1), dtype=conv_states.dtype, device=x.device)
    _final_state_kernel[(num_seqs, triton.cdiv(dim, block_d))](
        x, conv_states, query_start_loc, read_slots, has_initial_state, new_states,
        x.stride(0), conv_states.stride(0), conv_states.stride(1), dim,
        K=kernel_size, BK=triton.next_power_of_2(kernel_size - 1), BD=block_d,
    )  # fmt: skip
    conv_states[write_slots] = new_states
    return out
