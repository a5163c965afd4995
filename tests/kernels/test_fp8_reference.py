"""The block-FP8 torch references (``kernels.linear.reference``): quantize, dequantize, matmul,
on shapes with partial edge blocks (the ceil-div block grid of the published format)."""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.linear.reference import (
    FP8_E4M3_MAX, fp8_block_dequant, fp8_block_matmul_reference, fp8_block_quantize,
)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (5, 130), (3, 72, 260)])
def test_quantize_dequantize_round_trip_with_partial_blocks(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=gen) * torch.linspace(0.01, 3.0, shape[-1])
    q, s = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    # Each block's amax maps to 448 exactly.
    deq = fp8_block_dequant(q, s)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            block = w[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = block.abs().flatten(-2).amax(-1)
            torch.testing.assert_close(s[..., i, j], amax / FP8_E4M3_MAX)
            qb = q[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert torch.equal(qb.abs().flatten(-2).amax(-1), torch.full_like(amax, FP8_E4M3_MAX))
    scale = s.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)).all()
    assert (deq - w).abs().max() > 0


def test_dequant_is_elementwise_product_of_block_scale() -> None:
    q = torch.ones(130, 260).to(torch.float8_e4m3fn)
    s = torch.arange(1.0, 7.0).reshape(2, 3)
    deq = fp8_block_dequant(q, s, dtype=torch.bfloat16)
    assert deq.dtype == torch.bfloat16
    assert deq[0, 0] == 1 and deq[127, 255] == 2 and deq[128, 0] == 4 and deq[129, 259] == 6 and deq[0, 256] == 3
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_block_dequant(q, torch.ones(1, 3))


def test_zero_block_gets_unit_scale() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, s = fp8_block_quantize(w)
    assert s[0, 0] == 1.0 and torch.equal(fp8_block_dequant(q, s), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_reference_is_linear_on_dequantized_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen)
    x = torch.randn(7, 300, generator=gen).to(dtype)
    q, s = fp8_block_quantize(w)
    out = fp8_block_matmul_reference(x, q, s)
    assert out.dtype == dtype and out.shape == (7, 200)
    expected = (x.float() @ fp8_block_dequant(q, s).T).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * expected.abs().max().item())
    # ... and near the unquantized product (3 mantissa bits per weight, errors averaging over K).
    full = x.float() @ w.T
    assert (out.float() - full).abs().max() <= 0.05 * full.abs().max()


@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_fused_moe_fp8_equals_fused_moe_on_dequantized_experts(block: tuple[int, int]) -> None:
    """Dequantizing only the selected experts gives ``fused_moe`` on all experts dequantized;
    intermediate 72 and hidden 160 leave partial edge blocks."""
    from phloem.kernels.moe.reference import fused_moe, fused_moe_fp8, moe_route

    gen = torch.Generator().manual_seed(2)
    e, hidden, inter, t = 6, 160, 72, 9
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) / inter**0.5
    q13, s13 = fp8_block_quantize(w13, block)
    q2, s2 = fp8_block_quantize(w2, block)
    x = torch.randn(t, hidden, generator=gen)
    weights, ids = moe_route(torch.randn(t, e, generator=gen), 2, True)
    out = fused_moe_fp8(x, q13, s13, q2, s2, weights, ids, block)
    ref = fused_moe(x, fp8_block_dequant(q13, s13, block), fp8_block_dequant(q2, s2, block), weights, ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert not torch.equal(out, fused_moe(x, w13, w2, weights, ids))
