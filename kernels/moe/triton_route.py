"""Fused router softmax + top-k + renormalise: Triton version of ``kernels.moe.reference.moe_route``.

Shapes (as the reference): ``router_logits`` ``[T, E]`` with unit last stride and ``E <= 1024``;
returns ``topk_weights`` ``[T, top_k]`` in the logits dtype and ``topk_ids`` ``[T, top_k]`` int64,
sorted by descending weight.

One program per token keeps the whole row of ``E`` logits in registers (``route_row``): ``top_k``
rounds of "arg-max (the lowest index holding the maximum), knock it out" on the logits, the
selected experts' fp32 softmax probabilities, then the optional renormalisation; it writes
``2 * top_k`` values. The reference runs ~5 launches and round-trips the ``[T, E]`` fp32
probabilities through memory. ``select_expert`` finds one slot's expert alone, by the same rounds,
so the experts' kernel can route in each of its programs and agree with ``route_row``.

Ties: among equal logits the lowest expert index is taken first. ``torch.topk`` makes no such
promise (on CPU it returned ``[1, 5, 2]`` for three equal maxima at 1, 2 and 5), so on exact ties
the ids can be a permutation of the reference's while the weights agree. Selecting on logits
rather than on probabilities is the same order, except where two logits a hair apart round to
one fp32 probability: the reference may then take either.

Memory traffic at the 35B-A3B decode shape (256 experts, top 8, bf16, one token): 512 B read,
16 B + 64 B written: one launch, where the reference takes several.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


__all__ = ["moe_route", "moe_route_shared", "route_row", "select_expert", "select_in"]

MAX_EXPERTS = 1024
# One warp: the top-k rounds are serial reductions and cross-warp ones cost more than they save.


@triton.jit
def route_row(
    p_logits, p_weights, p_ids, E,
    TOP_K: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr,
):  # fmt: skip
    """Route one token: its ``E`` (+1) logits at ``p_logits`` -> ``TOP_K`` (+1) weights and ids.

    Experts are selected on the logits (softmax is monotonic), each round one arg-max; the weights
    are their fp32 softmax probabilities over all ``E``. ``select_expert`` makes the same choice."""
    # With a shared expert, each row holds E routed logits then its gate logit; outputs get a
    # (k+1)-th column (sigmoid(gate), E).
    o_e = tl.arange(0, BE)
    o_k = tl.arange(0, BK)
    m_e = o_e < E
    m_k = o_k < TOP_K

    b_l = tl.load(p_logits + o_e, mask=m_e, other=-float("inf")).to(tl.float32)
    b_max = tl.max(b_l)
    b_z = tl.sum(tl.where(m_e, tl.exp(b_l - b_max), 0.0))

    b_w = tl.zeros([BK], dtype=tl.float32)
    b_i = tl.zeros([BK], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        b_top, i_sel = tl.max(b_l, 0, return_indices=True, return_indices_tie_break_left=True)
        b_w = tl.where(o_k == j, tl.exp(b_top - b_max) / b_z, b_w)
        b_i = tl.where(o_k == j, i_sel.to(tl.int64), b_i)
        b_l = tl.where(o_e == i_sel, -float("inf"), b_l)
    if RENORMALIZE:
        b_w = b_w / tl.sum(b_w)

    tl.store(p_weights + o_k, b_w.to(p_weights.dtype.element_ty), mask=m_k)
    tl.store(p_ids + o_k, b_i, mask=m_k)
    if HAS_SHARED:
        b_g = tl.load(p_logits + E).to(p_weights.dtype.element_ty)
        b_s = tl.sigmoid(b_g.to(tl.float32)).to(p_weights.dtype.element_ty)
        tl.store(p_weights + TOP_K, b_s)
        tl.store(p_ids + TOP_K, E.to(tl.int64))


@triton.jit
def select_expert(p_logits, j, E, BE: tl.constexpr):
    """The id ``route_row`` puts in slot ``j`` (the ``j``-th largest of the ``E`` logits, ties to the
    lowest id), found alone: ``j + 1`` arg-max rounds (``kernels.moe.triton_decode`` routes in the
    experts' programs with it)."""
    o_e = tl.arange(0, BE)
    b_l = tl.load(p_logits + o_e, mask=o_e < E, other=-float("inf")).to(tl.float32)
    return select_in(b_l, o_e, j)


@triton.jit
def select_in(b_l, o_e, j):
    """``select_expert`` over logits already in registers (``-inf`` past the experts)."""
    i_sel = tl.zeros([], dtype=tl.int32)
    for _ in range(0, j + 1):
        _, i_sel = tl.max(b_l, 0, return_indices=True, return_indices_tie_break_left=True)
        b_l = tl.where(o_e == i_sel, -float("inf"), b_l)
    return i_sel


@triton.jit
def moe_route_kernel(
    logits,
    topk_weights,
    topk_ids,
    s_lt,
    E,
    TOP_K: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SHARED: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the previous kernel's writes first (kernels/common/pdl.py)
    i_t = tl.program_id(0).to(tl.int64)
    S_OUT: tl.constexpr = TOP_K + HAS_SHARED
    route_row(logits + i_t * s_lt, topk_weights + i_t * S_OUT, topk_ids + i_t * S_OUT, E,
              TOP_K, BE, BK, RENORMALIZE, HAS_SHARED)  # fmt: skip


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) then top-k; returns ``(topk_weights [T, k] in logits dtype, topk_ids [T, k] int64)``."""
    return _route(router_logits, top_k, renormalize, False, pdl)


def moe_route_shared(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.moe.reference.moe_route_shared``: ``[T, E + 1]`` logits -> ``[T, k + 1]`` weights and ids."""
    return _route(router_logits, top_k, renormalize, True, pdl)


def _route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared: bool, pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_cols = router_logits.shape
    num_experts = num_cols - int(shared)
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"need 1 <= top_k <= E <= {MAX_EXPERTS}, got top_k={top_k}, E={num_experts}"
        )
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    width = top_k + int(shared)
    topk_weights = torch.empty((num_tokens, width), dtype=router_logits.dtype, device=device)
    topk_ids = torch.empty((num_tokens, width), dtype=torch.int64, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    moe_route_kernel[(num_tokens,)](
        router_logits, topk_weights, topk_ids, router_logits.stride(0), num_experts,
        TOP_K=top_k, BE=triton.next_power_of_2(num_experts), BK=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, HAS_SHARED=shared, num_warps=1, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return topk_weights, topk_ids
