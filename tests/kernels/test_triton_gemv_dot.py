"""The shared-memory GEMV prototype (``kernels.triton.gemv_dot``) against ``F.linear``: interpreter on
CPU at small shapes; the 35B-A3B decode shapes in bf16 on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear import linear as reference  # noqa: E402
from phloem.kernels.triton.gemv_dot import DotConfig, linear_dot  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, k, generator=gen).to(DEVICE, dtype), (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)


@pytest.mark.parametrize(("n", "k"), [(16, 32), (50, 100), (33, 64)], ids=str)
@pytest.mark.parametrize("config", [DotConfig(16, 32, 2, 4), DotConfig(32, 16, 3, 4)], ids=str)
def test_one_row_matches_the_reference_fp32(n: int, k: int, config: DotConfig, assert_close) -> None:
    """Rows and columns past the tiles (50 x 100) are masked; only column 0 of the product is kept."""
    x, w = _inputs(n, k, torch.float32, seed=n + k)
    y = linear_dot(x, w, config)
    assert y.shape == (1, n)
    assert_close(y, reference(x, w), atol=1e-5, rtol=1e-4)


def test_rejects_what_it_does_not_cover() -> None:
    x, w = _inputs(16, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one row"):
        linear_dot(x.repeat(2, 1), w, DotConfig(16, 32, 2, 4))
    with pytest.raises(ValueError, match="unit-stride"):
        linear_dot(x[:, :16], w.t().contiguous().t()[:, :16], DotConfig(16, 32, 2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k"), [(12352, 2048), (2048, 4096), (248320, 2048)], ids=str)
def test_real_shapes_on_the_gpu(n: int, k: int) -> None:
    x, w = _inputs(n, k, torch.bfloat16, seed=3)
    want = reference(x.float(), w.float())
    for config in (DotConfig(32, 128, 4, 4), DotConfig(64, 64, 4, 4)):
        got = linear_dot(x, w, config).float()
        assert float((got - want).norm() / want.norm()) < 1e-2, config
