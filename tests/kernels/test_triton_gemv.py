"""The single-token Triton GEMV against ``F.linear`` (interpreter on CPU; real shapes on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear.reference import linear as reference  # noqa: E402
from phloem.kernels.linear.triton_gemv import linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 7), (64, 33), (130, 1024), (8, 2100)], ids=str)
def test_one_row_matches_the_reference_fp32(n: int, k: int, assert_close) -> None:
    x, w = _inputs(n, k, torch.float32, seed=n + k)
    y = linear(x, w)
    assert y.shape == (1, n) and y.dtype == x.dtype
    assert_close(y, reference(x, w), atol=1e-5, rtol=1e-4)


def test_bf16_rounds_once_from_fp32(assert_close) -> None:
    x, w = _inputs(48, 300, torch.bfloat16, seed=3)
    expected = (x.float() @ w.float().T).to(torch.bfloat16)
    # One rounding of the fp32 sum; the interpreter truncates where torch rounds: a bf16 ulp or two.
    assert_close(linear(x, w), expected, atol=2e-2, rtol=2e-2)


def test_a_strided_weight_view_and_other_shapes_fall_back(assert_close) -> None:
    x, w = _inputs(16, 64, torch.float32, seed=5)
    wide = torch.cat((w, w), dim=1)[:, :64]  # row stride 128, unit last stride: the kernel
    assert_close(linear(x, wide), reference(x, w), atol=1e-5, rtol=1e-4)
    x3, _ = _inputs(16, 64, torch.float32, seed=6, rows=3)  # three rows: F.linear
    assert torch.equal(linear(x3, w), reference(x3, w))
    assert_close(linear(x[0], w), reference(x[0], w), atol=1e-5, rtol=1e-4)  # a 1-D row: the kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k"), [(2048, 4096), (2048, 2048)], ids=["out_proj", "tp2_out_proj"])
def test_real_shapes_on_the_gpu(n: int, k: int) -> None:
    x, w = _inputs(n, k, torch.bfloat16, seed=7)
    got, want = linear(x, w).float(), (x.float() @ w.float().T)
    assert (got - want).norm() / want.norm() < 1e-2
