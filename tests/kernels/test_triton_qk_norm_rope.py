from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.attention.qk_norm_rope import qk_norm_rope_gate as reference  # noqa: E402
from phloem.kernels.attention.qk_norm_rope import qk_norm_rope_gate_store as reference_store  # noqa: E402
from phloem.kernels.attention.rope import rope_inv_freq  # noqa: E402
from phloem.kernels.attention.triton_qk_norm_rope import qk_norm_rope_gate, qk_norm_rope_gate_store  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
THETA = 10_000_000.0

# (T, Hq, Hk, D, rotary_dim): size 1, odd head dim and rotary half, full rotary, no rotary dims.
SHAPES = {
    "T1_mha1_D16_R4": (1, 1, 1, 16, 4),
    "T5_gqa3x2_D24_R6": (5, 3, 2, 24, 6),
    "T3_gqa4x1_D20_R20": (3, 4, 1, 20, 20),
    "T2_gqa2x2_D8_R0": (2, 2, 2, 8, 0),
}


def _inputs(num_tokens, num_q_heads, num_k_heads, head_dim, rotary_dim, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    q_gate = randn(num_tokens, num_q_heads, 2 * head_dim, scale=2)
    k = randn(num_tokens, num_k_heads, head_dim, scale=2)
    q_norm_w, k_norm_w = randn(head_dim, scale=0.1), randn(head_dim, scale=0.1)
    # Out of order and large: varlen batches restart positions per request.
    positions = torch.randint(0, 262_144, (num_tokens,), generator=gen).to(DEVICE)
    inv_freq = rope_inv_freq(rotary_dim, THETA).to(DEVICE)
    return q_gate, k, q_norm_w, k_norm_w, positions, inv_freq


def _check(assert_close, args, tol) -> None:
    q, k, gate = qk_norm_rope_gate(*args, EPS)
    expected_q, expected_k, expected_gate = reference(*args, EPS)
    assert_close(q, expected_q, **tol, msg="q")
    assert_close(k, expected_k, **tol, msg="k")
    assert_close(gate, expected_gate, exact=True, msg="gate")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_hf_attention_prologue(hf_qwen3_next: ModuleType, assert_close, dtype) -> None:
    """The torch reference against HF ``Qwen3NextAttention``'s split, q/k norms and partial RoPE."""
    from transformers import Qwen3NextConfig

    num_tokens, num_q_heads, num_k_heads, head_dim = 5, 4, 2, 32
    gen = torch.Generator().manual_seed(1)
    q_gate = torch.randn(num_tokens, num_q_heads, 2 * head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_k_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 40_000, (num_tokens,), generator=gen)
    q_norm = hf_qwen3_next.Qwen3NextRMSNorm(head_dim, eps=EPS).to(dtype)
    k_norm = hf_qwen3_next.Qwen3NextRMSNorm(head_dim, eps=EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(head_dim, generator=gen) * 0.1)
        k_norm.weight.copy_(torch.randn(head_dim, generator=gen) * 0.1)
    config = Qwen3NextConfig(
        hidden_size=64,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_k_heads,
        head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": THETA, "partial_rotary_factor": 0.25},
    )
    with torch.no_grad():
        query, gate = torch.chunk(q_gate, 2, dim=-1)
        cos, sin = hf_qwen3_next.Qwen3NextRotaryEmbedding(config)(q_gate, positions[None])
        q_ref, k_ref = hf_qwen3_next.apply_rotary_pos_emb(
            q_norm(query)[None], k_norm(k)[None], cos, sin, unsqueeze_dim=2
        )
        q, k_out, gate_out = reference(
            q_gate, k, q_norm.weight, k_norm.weight, positions, rope_inv_freq(head_dim // 4, THETA), EPS
        )
    assert_close(q, q_ref[0], exact=True)
    assert_close(k_out, k_ref[0], exact=True)
    assert_close(gate_out, gate.reshape(num_tokens, -1), exact=True)


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference(assert_close, shape) -> None:
    _check(assert_close, _inputs(*shape), {})


def test_q_gate_as_a_view_of_the_projection(assert_close) -> None:
    """``q_proj(hidden).view(T, Hq, 2D)`` of a wider fused projection: token stride != Hq * 2D."""
    q_gate, k, *rest = _inputs(3, 2, 1, 16, 4, seed=2)
    wide = torch.cat((q_gate.flatten(1), k.flatten(1)), dim=-1)
    q_view = wide[:, : q_gate[0].numel()].view(q_gate.shape)
    assert not q_view.is_contiguous()
    _check(assert_close, (q_view, k, *rest), {})


def test_bfloat16_runs_and_keeps_dtypes(assert_close) -> None:
    """Dtype plumbing on CPU: the interpreter truncates fp32 -> bf16 instead of rounding to nearest."""
    args = _inputs(3, 2, 2, 32, 8, dtype=torch.bfloat16, seed=3)
    _check(assert_close, args, {"atol": 3e-2, "rtol": 3e-2} if DEVICE.type == "cpu" else {})


def _check_store(assert_close, args, tol, page_size: int = 4, seed: int = 0) -> None:
    """The fused cache write against the reference composition, from the same random cache: the
    written slots hold K (rotated) and V, every other slot is untouched."""
    q_gate, k, *rest = args
    num_tokens, num_k_heads, head_dim = k.shape
    gen = torch.Generator().manual_seed(seed)
    v = (torch.randn(k.shape, generator=gen)).to(DEVICE, k.dtype)
    num_pages = num_tokens // page_size + 3
    cache = torch.randn(num_pages, 2, page_size, num_k_heads, head_dim, generator=gen).to(DEVICE, k.dtype)
    # Distinct slots, out of order and across pages (a varlen batch's tokens).
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens].to(DEVICE)
    got_cache, want_cache = cache.clone(), cache.clone()
    q, gate = qk_norm_rope_gate_store(q_gate, k, v, *rest, EPS, got_cache, slots)
    want_q, want_gate = reference_store(q_gate, k, v, *rest, EPS, want_cache, slots)
    assert_close(q, want_q, **tol, msg="q")
    assert_close(gate, want_gate, exact=True, msg="gate")
    page, off = slots // page_size, slots % page_size
    assert_close(got_cache[page, 0, off], want_cache[page, 0, off], **tol, msg="k in the cache")
    assert_close(got_cache[page, 1, off], want_cache[page, 1, off], exact=True, msg="v in the cache")
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    flat = lambda c: c.transpose(1, 2).reshape(num_pages * page_size, 2, num_k_heads, head_dim)  # noqa: E731
    assert torch.equal(flat(got_cache)[untouched], flat(cache)[untouched]), "a slot outside slot_mapping changed"


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_store_variant_writes_the_cache_like_the_reference(assert_close, shape) -> None:
    _check_store(assert_close, _inputs(*shape), {})


def test_store_variant_with_strided_k_and_v(assert_close) -> None:
    """k and v as column slices of one fused qkv projection output (the model's case)."""
    q_gate, k, *rest = _inputs(6, 2, 2, 16, 4, seed=5)
    wide = torch.cat((k.flatten(1), k.flatten(1) * 0.5), dim=-1)
    k_view = wide[:, : k[0].numel()].view(k.shape)
    assert not k_view.is_contiguous()
    _check_store(assert_close, (q_gate, k_view, *rest), {}, page_size=2, seed=6)


def _fp8_steps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per element, how many e4m3 steps separate two fp8 tensors (0: equal)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    order = codes[~codes.isnan()].unique()  # every finite e4m3 value, ascending
    rank = lambda t: torch.searchsorted(order, t.float().flatten())  # noqa: E731
    return (rank(got) - rank(want)).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_into_fp8_pages_saturates_like_the_reference(dtype) -> None:
    """FP8 KV pages (unit scale): k and v rounded in the input dtype, clamped to +-448, cast to
    e4m3 (on the GPU ``cvt.rn.satfinite``: v exact, k within one step where the fused norm/RoPE
    differs in its last input-dtype bit). v is scaled so that some of it saturates. The
    interpreter's fp32 -> e4m3 emulation rounds ties away, flushes subnormals and halves a value
    that rounds up to a power of two (127.6 -> 64), so on CPU those elements are left out."""
    q_gate, k, *rest = _inputs(6, 2, 2, 16, 4, dtype=dtype, seed=8)
    v = (torch.randn(k.shape, generator=torch.Generator().manual_seed(9)) * 300).to(DEVICE, dtype)
    slots = torch.tensor([3, 0, 9, 4, 15, 6], device=DEVICE)
    got = torch.zeros(4, 2, 4, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    want = got.clone()
    q, gate = qk_norm_rope_gate_store(q_gate, k, v, *rest, EPS, got, slots)
    reference_store(q_gate, k, v, *rest, EPS, want, slots)
    assert q.dtype == dtype and gate.dtype == dtype
    page, off = slots // 4, slots % 4
    for plane, steps in ((1, 0), (0, 1)):
        g, w = got[page, plane, off].float().flatten(), want[page, plane, off].float().flatten()
        assert not w.isnan().any() and (plane == 0 or w.abs().max() == 448), "v should saturate, not overflow"
        keep = torch.ones_like(w, dtype=torch.bool)
        if DEVICE.type == "cpu":
            exponent = torch.frexp(w.abs())[1].float()
            keep = (w.abs() >= 2**-6) & (w.abs() != torch.exp2(exponent - 1))
            steps = 1
        assert keep.sum() > w.numel() // 2, "too few elements left to compare"
        apart = _fp8_steps_apart(g[keep], w[keep])
        over = int((apart > steps).sum())
        assert over == 0, f"plane {plane}: {over} elements over {steps} fp8 steps apart"


def test_rejects_mismatched_head_dims() -> None:
    q_gate, k, *rest = _inputs(2, 2, 1, 16, 4)
    with pytest.raises(ValueError, match="q_gate must be"):
        qk_norm_rope_gate(q_gate[..., :30], k, *rest, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 8, 1000])
def test_qwen35_35b_a3b_shape_on_cuda(assert_close, num_tokens, dtype) -> None:
    """16 q / 2 kv heads of 256, rotary 64; positions up to 256K exercise cos/sin range reduction."""
    args = _inputs(num_tokens, 16, 2, 256, 64, dtype=dtype, seed=4)
    _check(assert_close, args, {})
    _check_store(assert_close, args, {}, page_size=16, seed=7)
