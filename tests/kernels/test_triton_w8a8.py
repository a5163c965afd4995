"""The W8A8 block-FP8 Triton kernels (``kernels.linear.triton_w8a8``) against their torch references
(``kernels.linear.w8a8``), under the interpreter on CPU.

NOTE: Triton 3.6's interpreter casts fp32 to ``float8e4nv`` with its own bit arithmetic, which is
not round-to-nearest-even: a mantissa carry lands in the wrong exponent bit, ties round up and e4m3
subnormals come out wrong (e.g. 125.4 -> 64 where RNE gives 128). On sm_90 the cast is
``cvt.rn.satfinite.e4m3x2.f32`` (checked in ``tests/support/triton_codegen.py``). So the quantization
kernel is checked bit for bit in two ways the interpreter gets right: with an fp32 output, the
values it casts (and its scales) equal the reference's; and with the e4m3 output, on inputs whose
quantized values are exact normal e4m3 numbers (no rounding left to the cast). The fp8 ``tl.dot``
itself runs in the interpreter (e4m3 products are exact, fp32 sums), so the GEMM runs as written.
"""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear.fp8 import FP8_E4M3_MAX, Fp8Weight, fp8_block_quantize  # noqa: E402
from phloem.kernels.linear.triton_w8a8 import act_quant_into, fp8_act_quant, fp8_w8a8_linear, w8a8_block_matmul  # noqa: E402
from phloem.kernels.linear.w8a8 import fp8_act_quant as act_quant_reference  # noqa: E402
from phloem.kernels.linear.w8a8 import fp8_w8a8_block_matmul_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t.view(torch.int32)


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian rows with a per-column spread (groups of different ranges), a zero group, a spike."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)
    x[0, : min(k, 128)] = 0.0
    x[-1, k // 2] = 300.0
    return x.to(DEVICE, dtype)


def _scaled_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's values before its e4m3 cast, and its scales."""
    _, scale = act_quant_reference(x.cpu())
    full = scale.repeat_interleave(128, dim=1)[:, : x.shape[1]]
    return (x.cpu().float() / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX), scale


@pytest.mark.parametrize(("m", "k"), [(1, 7), (3, 128), (5, 300), (2, 1100)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_act_quant_casts_the_reference_values_bit_for_bit(m: int, k: int, dtype: torch.dtype) -> None:
    x = _activations(m, k, dtype, seed=m * k)
    q = torch.empty(m, k, device=DEVICE)
    scale = torch.empty(m, -(-k // 128), device=DEVICE)
    act_quant_into(x, q, scale)
    want_q, want_scale = _scaled_reference(x)
    assert torch.equal(_bits(scale.cpu()), _bits(want_scale))
    assert torch.equal(_bits(q.cpu()), _bits(want_q))
    # ... and the reference's e4m3 values are those values cast (round to nearest even).
    assert torch.equal(_bits(want_q.to(E4M3)), _bits(act_quant_reference(x.cpu())[0]))


@pytest.mark.parametrize(("m", "k"), [(1, 7), (4, 300), (3, 1100)], ids=str)
def test_act_quant_e4m3_output_equals_the_reference_on_exact_values(m: int, k: int) -> None:
    """Each group is e4m3 values with its amax at +-448, times a power of two: the scale is that
    power, the quantized values those e4m3 values (normal ones, so the interpreter's cast is exact)."""
    gen = torch.Generator().manual_seed(k)
    q = torch.randint(0x08, 0x7F, (m, k), generator=gen, dtype=torch.uint8)  # positive normal e4m3, not NaN
    q |= torch.randint(0, 2, (m, k), generator=gen, dtype=torch.uint8) << 7
    q[:, ::128] = 0x7E  # 448
    power = torch.exp2(torch.randint(-12, 4, (m, -(-k // 128)), generator=gen).float())
    x = (q.view(E4M3).float() * power.repeat_interleave(128, dim=1)[:, :k]).to(DEVICE)
    got_q, got_scale = fp8_act_quant(x)
    want_q, want_scale = act_quant_reference(x.cpu())
    assert torch.equal(want_scale, power)
    assert torch.equal(got_scale.cpu(), want_scale) and torch.equal(_bits(got_q.cpu()), _bits(want_q))
    assert torch.equal(_bits(want_q), q)


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5 * torch.linspace(0.1, 2.0, n)[:, None]
    data, scale = fp8_block_quantize(w, (1, 128))
    return Fp8Weight(data.to(DEVICE), scale.to(DEVICE), dtype)


# (M, N, K): one token, batched decode, a prefill with two row tiles; N and K off the 128 tiles.
SHAPES = [(1, 7, 100), (5, 200, 300), (33, 130, 384), (130, 72, 129)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=str)
def test_gemm_matches_the_reference_fp32(m: int, n: int, k: int) -> None:
    """The GEMM on the reference's quantized activations, fp32 out: both sum the same exact
    products in fp32, in another order and with the scales applied per K block rather than per
    element, so they agree to fp32 rounding: ``|got - want| <= 1e-5 * (|x̂| @ |ŵ|^T)``. On sm_90
    the FP8 wgmma accumulates a 128-wide K block in fewer bits (about 14, DeepSeek-V3's report)
    before the kernel adds it into fp32, so there the bound is ``2^-12``."""
    weight = _weight(n, k, torch.float32, seed=n + k)
    x = _activations(m, k, torch.float32, seed=m + k)
    x_fp8, x_scale = act_quant_reference(x.cpu())
    out = torch.empty(m, n, device=DEVICE)
    w8a8_block_matmul(x_fp8.to(DEVICE), x_scale.to(DEVICE), weight.data, weight.scale_inv, out)
    want = fp8_w8a8_block_matmul_reference(x.cpu(), Fp8Weight(weight.data.cpu(), weight.scale_inv.cpu(), torch.float32))
    x_hat = x_fp8.float() * x_scale.repeat_interleave(128, 1)[:, :k]
    w_hat = weight.dense().cpu()
    bound = (2**-12 if torch.cuda.is_available() else 1e-5) * (x_hat.abs() @ w_hat.abs().T)
    err = (out.cpu() - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3e}, max excess {(err - bound).max():.3e}"
    assert want.abs().max() > 0


@pytest.mark.parametrize(("m", "n", "k"), SHAPES[1:3], ids=str)
def test_linear_bf16_rounds_once(m: int, n: int, k: int, assert_close) -> None:
    """The whole op in bf16 (the kernels' quantization, then the GEMM) on activations whose
    quantization is exact (as above), so the only difference is the final rounding: a bf16 ulp."""
    weight = _weight(n, k, torch.bfloat16, seed=n)
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(0x08, 0x7F, (m, k), generator=gen, dtype=torch.uint8) | (
        torch.randint(0, 2, (m, k), generator=gen, dtype=torch.uint8) << 7)  # fmt: skip
    q[:, ::128] = 0x7E
    x = (q.view(E4M3).float() * 2.0**-6).to(torch.bfloat16).to(DEVICE)
    got = fp8_w8a8_linear(x[None], weight)  # a leading batch dimension is kept
    assert got.shape == (1, m, n) and got.dtype == torch.bfloat16
    want = fp8_w8a8_block_matmul_reference(x.cpu(), Fp8Weight(weight.data.cpu(), weight.scale_inv.cpu(), torch.bfloat16))
    assert_close(got[0].cpu(), want, atol=1e-2, rtol=1e-2)


def test_reference_is_near_the_unquantized_product() -> None:
    """W8A8 on Gaussian data: within 5 % of the fp32 product's range (3 mantissa bits on each side)."""
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(64, 300, generator=gen) / 300**0.5
    x = torch.randn(6, 300, generator=gen)
    data, scale = fp8_block_quantize(w, (1, 128))
    got = fp8_w8a8_block_matmul_reference(x, Fp8Weight(data, scale, torch.float32))
    full = x @ w.T
    assert 0 < (got - full).abs().max() <= 0.05 * full.abs().max()
    with pytest.raises(ValueError, match="weight"):
        fp8_w8a8_block_matmul_reference(x[:, :200], Fp8Weight(data, scale, torch.float32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("m", "k"), [(7, 2048), (300, 4096)], ids=str)
def test_act_quant_bit_for_bit_on_the_gpu(m: int, k: int) -> None:
    x = _activations(m, k, torch.bfloat16, seed=k)
    got_q, got_scale = fp8_act_quant(x)
    want_q, want_scale = act_quant_reference(x.cpu())
    assert torch.equal(got_scale.cpu(), want_scale) and torch.equal(_bits(got_q.cpu()), _bits(want_q))
