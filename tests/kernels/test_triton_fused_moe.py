"""Small-batch fused MoE (Triton) against the torch reference ``kernels.moe.fused_moe``."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.moe import fused_moe as reference  # noqa: E402
from phloem.kernels.moe import moe_route  # noqa: E402
from phloem.kernels.triton.fused_moe import MoeDecodeConfig, fused_moe, fused_moe_tuned  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen).to(DEVICE, dtype)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 32, 16), (3, 8, 2, 48, 24), (5, 6, 3, 40, 20)],
    ids=["T1", "T3-pow2-experts", "T5-odd-dims"],
)
def test_matches_reference_fp32(assert_close, tokens: int, experts: int, top_k: int, hidden: int, inter: int) -> None:
    args = _inputs(tokens, experts, top_k, hidden, inter, torch.float32)
    got = fused_moe_tuned(*args, MoeDecodeConfig(16, 16, 4, 1, 16, 16, 4, 1))
    assert_close(got, reference(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_matches_reference_real_shape_bf16(assert_close, tokens: int) -> None:
    args = _inputs(tokens, 256, 8, 2048, 512, torch.bfloat16)
    expected = reference(*(a.float() if a.is_floating_point() else a for a in args))
    assert_close(fused_moe(*args).float(), expected, atol=2e-2, rtol=2e-2)
