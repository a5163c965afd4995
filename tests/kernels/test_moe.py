from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from phloem.kernels.moe.reference import fused_moe, moe_route

HIDDEN, INTERMEDIATE = 24, 10
DTYPES = [torch.float32, torch.bfloat16]
# (num_experts, top_k)
ROUTING = {"E8_k2": (8, 2), "E5_k1": (5, 1), "E6_k6": (6, 6)}


def _config(num_experts: int, top_k: int, renormalize: bool):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=INTERMEDIATE,
        norm_topk_prob=renormalize,
        hidden_act="silu",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renormalized"])
@pytest.mark.parametrize("routing", list(ROUTING), ids=list(ROUTING))
@pytest.mark.parametrize("num_tokens", [1, 7], ids=["T1", "T7"])
def test_route_matches_hf(hf_qwen3_next: ModuleType, assert_close, num_tokens, routing, renormalize, dtype) -> None:
    torch.manual_seed(0)
    num_experts, top_k = ROUTING[routing]
    router = hf_qwen3_next.Qwen3NextTopKRouter(_config(num_experts, top_k, renormalize)).to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        logits, expected_weights, expected_ids = router(torch.randn(num_tokens, HIDDEN).to(dtype))
    topk_weights, topk_ids = moe_route(logits, top_k, renormalize)
    assert_close(topk_weights, expected_weights, exact=True)
    assert topk_ids.dtype == torch.int64
    assert torch.equal(topk_ids, expected_ids)


def _moe_inputs(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype):
    torch.manual_seed(num_tokens * 7 + num_experts)
    x = torch.randn(num_tokens, HIDDEN).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN) * 0.2).to(dtype)
    w_down = (torch.randn(num_experts, HIDDEN, INTERMEDIATE) * 0.2).to(dtype)
    topk_weights, topk_ids = moe_route(torch.randn(num_tokens, num_experts).to(dtype), top_k, renormalize=True)
    return x, w_gate_up, w_down, topk_weights, topk_ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("routing", list(ROUTING), ids=list(ROUTING))
@pytest.mark.parametrize("num_tokens", [1, 9], ids=["T1", "T9"])
def test_fused_moe_matches_hf(hf_qwen3_next: ModuleType, assert_close, num_tokens, routing, dtype) -> None:
    num_experts, top_k = ROUTING[routing]
    x, w_gate_up, w_down, topk_weights, topk_ids = _moe_inputs(num_tokens, num_experts, top_k, dtype)
    experts = hf_qwen3_next.Qwen3NextExperts(_config(num_experts, top_k, True)).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
        expected = experts(x, topk_ids, topk_weights)
    # Same ops in the same order as HF, but transformers >= 5.24 batches the expert GEMMs
    # differently, which moves fp32 results by an ulp: fp32 gets a few ulps, bf16 stays exact
    # (its rounding after every index_add is what the reference mirrors).
    if dtype == torch.float32:
        assert_close(fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids), expected, atol=1e-6, rtol=1e-6)
    else:
        assert_close(fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids), expected, exact=True)


@pytest.mark.parametrize("routing", list(ROUTING), ids=list(ROUTING))
def test_fused_moe_matches_per_token_loop(assert_close, routing) -> None:
    num_experts, top_k = ROUTING[routing]
    x, w_gate_up, w_down, topk_weights, topk_ids = _moe_inputs(5, num_experts, top_k, torch.float32)
    expected = torch.zeros(5, HIDDEN, dtype=torch.float64)
    for t in range(5):
        for weight, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate, up = (w_gate_up[e].double() @ x[t].double()).chunk(2)
            expected[t] += weight * (w_down[e].double() @ (F.silu(gate) * up))
    assert_close(fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids), expected.float())
