"""Small-batch fused MoE (Triton) against the torch reference ``kernels.moe.reference.fused_moe``."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.moe.reference import fused_moe as reference  # noqa: E402
from phloem.kernels.moe.reference import fused_moe_routed as reference_routed  # noqa: E402
from phloem.kernels.moe.reference import moe_route  # noqa: E402
from phloem.kernels.moe.triton_decode import MoeDecodeConfig, fused_moe, fused_moe_routed, fused_moe_tuned  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE, dtype)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.parametrize("down_prefetch", [True, False], ids=["down-prefetch", "down-one-tile"])
@pytest.mark.parametrize("block_k2", [16, 8], ids=["k-block", "k-blocks"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 32, 16), (3, 8, 2, 48, 24), pytest.param(5, 6, 3, 40, 20, marks=pytest.mark.slow), (1, 5, 1, 32, 16)],
    ids=["T1", "T3-pow2-experts", "T5-odd-dims", "T1-one-slot"],
)
def test_matches_reference_fp32(
    assert_close, tokens: int, experts: int, top_k: int, hidden: int, inter: int,
    block_k2: int, down_prefetch: bool,
) -> None:  # fmt: skip
    """Both down-stage walks (``launch_down_sum``'s ``prefetch``: the next step's tile in flight and
    the ids a step further ahead, or one step at a time), over one or several K blocks a slot and
    one slot or more (one step: nothing to prefetch)."""
    args = _inputs(tokens, experts, top_k, hidden, inter, torch.float32)
    got = fused_moe_tuned(*args, MoeDecodeConfig(16, 16, 4, 1, 16, block_k2, 4, 1), down_prefetch=down_prefetch)
    assert_close(got, reference(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_matches_reference_real_shape_bf16(assert_close, tokens: int) -> None:
    args = _inputs(tokens, 256, 8, 2048, 512, torch.bfloat16)
    expected = reference(*(a.float() if a.is_floating_point() else a for a in args))
    assert_close(fused_moe(*args).float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_down_prefetch_walk_matches_the_one_tile_walk_bit_for_bit(tokens: int) -> None:
    """The prefetching down walk adds the same products in the same order as the one-tile walk, so
    at the real shape (bf16, compiled; one token's tiles and the batch tiles) the outputs are equal
    bit for bit."""
    from phloem.kernels.moe.triton_decode import _BATCH_CONFIG, _TOKEN_CONFIG, launch_down_sum

    _, _, w_down, weights, ids = _inputs(tokens, 256, 8, 2048, 512, torch.bfloat16)
    act = torch.randn(tokens * 8, 512, device=DEVICE).to(torch.bfloat16)
    for config in (_TOKEN_CONFIG, _BATCH_CONFIG):
        outs = [torch.empty(tokens, 2048, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
        for out, prefetch in zip(outs, (True, False)):
            launch_down_sum(act, w_down, ids, weights, out, config, prefetch=prefetch)
        assert torch.equal(outs[0], outs[1]), config


def _routed_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    """Experts ``0..E-1`` and the shared one as ``E``; logits ``[T, E + 1]`` (the shared gate's last)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(experts + 1, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts + 1, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts + 1, generator=gen).to(DEVICE, dtype)
    return x, logits, w_gate_up, w_down


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"),
    [(1, 8, 2, True), (3, 12, 4, False), (9, 6, 5, True)],
    ids=["T1", "T3-no-renorm", "T9-batch-config-odd-experts"],
)
def test_routing_in_the_kernel_matches_route_then_experts(
    assert_close, tokens: int, experts: int, top_k: int, renormalize: bool
) -> None:
    x, logits, w_gate_up, w_down = _routed_inputs(tokens, experts, top_k, 40, 24, torch.float32, seed=tokens)
    got = fused_moe_routed(x, logits, w_gate_up, w_down, top_k, renormalize)
    assert_close(got, reference_routed(x, logits, w_gate_up, w_down, top_k, renormalize), atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("tokens", [1, 2])
def test_routing_in_the_kernel_breaks_ties_like_the_route_kernel(assert_close, tokens: int) -> None:
    """Equal logits: every program of a token must pick the same experts (the lowest ids first)."""
    x, logits, w_gate_up, w_down = _routed_inputs(tokens, 8, 3, 32, 16, torch.float32, seed=7)
    logits[:, :8] = torch.tensor([0.5, 2.0, 2.0, 1.0, 2.0, -1.0, 2.0, 0.0], device=DEVICE)
    got = fused_moe_routed(x, logits, w_gate_up, w_down, 3, True)
    # Experts 1, 2 and 4 (not 6) hold the three equal maxima taken first.
    weights = torch.full((tokens, 3), 1 / 3, device=DEVICE)
    ids = torch.tensor([[1, 2, 4]] * tokens, device=DEVICE)
    shared = torch.sigmoid(logits[:, 8:])
    expected = reference(x, w_gate_up, w_down, torch.cat((weights, shared), 1), torch.cat((ids, torch.full_like(ids[:, :1], 8)), 1))
    assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_routed_rejects_more_slots_than_experts() -> None:
    x, logits, w_gate_up, w_down = _routed_inputs(1, 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_routed(x, logits, w_gate_up, w_down, 5, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_routed_real_shape_bf16(assert_close, tokens: int) -> None:
    x, logits, w_gate_up, w_down = _routed_inputs(tokens, 256, 8, 2048, 512, torch.bfloat16)
    expected = reference_routed(x.float(), logits.float(), w_gate_up.float(), w_down.float(), 8, True)
    assert_close(fused_moe_routed(x, logits, w_gate_up, w_down, 8, True).float(), expected, atol=2e-2, rtol=2e-2)
