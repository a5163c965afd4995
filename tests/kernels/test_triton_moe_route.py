from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.moe.reference import moe_route as reference  # noqa: E402
from phloem.kernels.moe.triton_route import moe_route  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (T, E, top_k): one expert, top-1, odd expert counts, the 35B-A3B router (256, 8).
SHAPES = {
    "T1_E1_k1": (1, 1, 1),
    "T4_E8_k1": (4, 8, 1),
    "T5_E37_k5": (5, 37, 5),
    "T3_E256_k8": (3, 256, 8),
    "T2_E6_k6": (2, 6, 6),
}


def _logits(num_tokens: int, num_experts: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, num_experts, generator=gen) * 2).to(DEVICE, dtype)


def _stable_topk_ids(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Reference ids with ties broken towards the lower expert index (the kernel's guarantee)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


def _check(assert_close, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    weights, ids = moe_route(router_logits, top_k, renormalize)
    expected_weights, expected_ids = reference(router_logits, top_k, renormalize)
    # Weights sorted by value do not depend on how ties are ordered.
    assert_close(weights, expected_weights, msg="weights")
    assert_close(ids, _stable_topk_ids(router_logits, top_k), exact=True, msg="ids")


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalize", "raw"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference(assert_close, shape, renormalize) -> None:
    num_tokens, num_experts, top_k = shape
    router_logits = _logits(num_tokens, num_experts)
    _check(assert_close, router_logits, top_k, renormalize)
    # Without ties the order is the reference's own.
    assert_close(moe_route(router_logits, top_k, renormalize)[1], reference(router_logits, top_k, renormalize)[1])


def test_ties_pick_the_lowest_expert_first(assert_close) -> None:
    router_logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    weights, ids = moe_route(router_logits, 4, False)
    assert ids.tolist() == [[1, 2, 5, 4], [0, 1, 2, 3]]
    assert_close(weights, reference(router_logits, 4, False)[0])


def test_bfloat16_logits(assert_close) -> None:
    """bf16 logits hold many exact ties; weights come back in bf16 (CPU: interpreter truncation)."""
    router_logits = _logits(6, 64, dtype=torch.bfloat16, seed=1)
    weights, ids = moe_route(router_logits, 8, True)
    expected_weights, _ = reference(router_logits, 8, True)
    tol = {"atol": 1e-2, "rtol": 1e-2} if DEVICE.type == "cpu" else {}
    assert_close(weights, expected_weights, **tol)
    assert_close(ids, _stable_topk_ids(router_logits, 8), exact=True)


@pytest.mark.parametrize(("num_experts", "top_k"), [(4, 0), (4, 5), (2048, 8)], ids=["k0", "k_gt_E", "E_too_large"])
def test_rejects_bad_sizes(num_experts, top_k) -> None:
    with pytest.raises(ValueError, match="top_k"):
        moe_route(torch.zeros(1, num_experts, device=DEVICE), top_k, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("num_experts", "top_k"), [(256, 8), (512, 10)], ids=["qwen35_35b_a3b", "qwen3_next_80b"]
)
@pytest.mark.parametrize("num_tokens", [1, 8, 4096])
def test_real_routers_on_cuda(assert_close, num_tokens, num_experts, top_k, dtype) -> None:
    _check(assert_close, _logits(num_tokens, num_experts, dtype=dtype, seed=2), top_k, renormalize=True)
