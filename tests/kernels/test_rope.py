from __future__ import annotations

from types import ModuleType

import pytest
import torch

from phloem.kernels.attention.rope import apply_partial_rope, rope_inv_freq

HEAD_DIM = 32
THETA = 10_000_000.0


def _hf_rotary(hf: ModuleType, partial_rotary_factor: float) -> torch.nn.Module:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": partial_rotary_factor},
    )
    return hf.Qwen3NextRotaryEmbedding(config)


@pytest.mark.parametrize("factor", [0.25, 1.0], ids=["partial_quarter", "full"])
def test_inv_freq_matches_hf(hf_qwen3_next: ModuleType, assert_close, factor) -> None:
    expected = _hf_rotary(hf_qwen3_next, factor).inv_freq
    assert_close(rope_inv_freq(int(HEAD_DIM * factor), THETA), expected, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("factor", [0.25, 1.0], ids=["partial_quarter", "full"])
@pytest.mark.parametrize(
    ("num_tokens", "num_q_heads", "num_k_heads"),
    [(1, 1, 1), (7, 4, 2), (33, 6, 3)],
    ids=["T1_mha1", "T7_gqa4x2", "T33_gqa6x3"],
)
def test_apply_partial_rope_matches_hf(
    hf_qwen3_next: ModuleType, assert_close, num_tokens, num_q_heads, num_k_heads, factor, dtype
) -> None:
    torch.manual_seed(0)
    q = torch.randn(num_tokens, num_q_heads, HEAD_DIM).to(dtype)
    k = torch.randn(num_tokens, num_k_heads, HEAD_DIM).to(dtype)
    # Out-of-order, large positions: varlen batches restart positions per request.
    positions = torch.randint(0, 40_000, (num_tokens,), dtype=torch.int64)
    rotary = _hf_rotary(hf_qwen3_next, factor)
    cos, sin = rotary(q, positions[None])  # [1, T, R]
    q_ref, k_ref = hf_qwen3_next.apply_rotary_pos_emb(q[None], k[None], cos, sin, unsqueeze_dim=2)

    q_out, k_out = apply_partial_rope(q, k, positions, rope_inv_freq(int(HEAD_DIM * factor), THETA))
    assert_close(q_out, q_ref[0], exact=True)
    assert_close(k_out, k_ref[0], exact=True)
    rotary_dim = int(HEAD_DIM * factor)
    assert_close(q_out[..., rotary_dim:], q[..., rotary_dim:], exact=True)


def test_position_zero_is_identity(assert_close) -> None:
    q, k = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 1, HEAD_DIM)
    q_out, k_out = apply_partial_rope(q, k, torch.zeros(3, dtype=torch.int64), rope_inv_freq(8, THETA))
    assert_close(q_out, q, exact=True)
    assert_close(k_out, k, exact=True)
