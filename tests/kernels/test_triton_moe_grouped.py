"""Prefill grouped-GEMM MoE (Triton) against the torch reference ``kernels.moe.reference.fused_moe``."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.moe.reference import fused_moe as reference  # noqa: E402
from phloem.kernels.moe.reference import moe_route, moe_route_shared  # noqa: E402
from phloem.kernels.moe.triton_grouped import fused_moe_grouped, sort_by_expert  # noqa: E402
from phloem.kernels.moe.triton_sort import sort_by_expert_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, shared: bool = False):
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    n = experts + int(shared)
    w_gate_up = (torch.randn(n, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(n, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, n, generator=gen).to(DEVICE, dtype)
    route = moe_route_shared if shared else moe_route
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


def test_sort_by_expert_blocks_hold_one_expert_each_and_every_pair_once() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [3, 0]])
    rows, block_e = sort_by_expert(ids, num_experts=5, block_m=2)
    blocks = rows.view(-1, 2)
    assert sorted(rows[rows >= 0].tolist()) == list(range(ids.numel()))
    for b, e in enumerate(block_e.tolist()):
        members = blocks[b][blocks[b] >= 0]
        if e >= 5:
            assert members.numel() == 0
        else:
            assert members.numel() > 0 and (ids.flatten()[members] == e).all()
    # Expert 3 has 4 pairs: two full blocks; experts 0 (3 pairs): two blocks, one padded; 4: none.
    assert block_e.tolist()[:6] == [0, 0, 1, 2, 3, 3]


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"),
                         [(5, 2, 5, 2), (37, 3, 6, 16), (300, 9, 257, 64), (3, 2, 16, 64), (1200, 9, 257, 64)])
def test_triton_layout_holds_the_reference_blocks(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    """The one-launch layout: the reference's blocks and, for each expert, the same pairs, in the
    same places but for their order among that expert's rows (the atomics' order on a GPU)."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)
    want_rows, want_e = sort_by_expert(ids, experts, block_m)
    rows, block_e = sort_by_expert_triton(ids, experts, block_m)
    assert torch.equal(block_e, want_e)
    assert torch.equal(rows >= 0, want_rows >= 0)  # each expert's rows fill its blocks from the front
    per_block = block_e.repeat_interleave(block_m)
    for e in range(experts):
        mine = per_block == e
        assert sorted(rows[mine].tolist()) == sorted(want_rows[mine].tolist()), f"expert {e}"


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "shared"),
    [(37, 6, 2, 48, 40, False), (20, 8, 3, 32, 16, True), (3, 16, 2, 16, 24, False)],
    ids=["padded-blocks", "shared-expert", "idle-experts"],
)
def test_matches_reference_fp32(assert_close, tokens, experts, top_k, hidden, inter, shared) -> None:
    args = _inputs(tokens, experts, top_k, hidden, inter, torch.float32, shared)
    got = fused_moe_grouped(*args, block_m=16, block_n=16, block_k=16)
    assert_close(got, reference(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [300, 4096])
def test_matches_reference_real_shape_bf16(assert_close, tokens: int) -> None:
    args = _inputs(tokens, 256, 8, 2048, 512, torch.bfloat16, shared=True)
    expected = reference(*(a.float() if a.is_floating_point() else a for a in args))
    assert_close(fused_moe_grouped(*args).float(), expected, atol=3e-2, rtol=3e-2)
