from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.norm import reference  # noqa: E402
from phloem.kernels.norm.triton_norm import add_rms_norm, gated_rms_norm, rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
SHAPES = [(1, 1), (1, 8), (7, 33), (3, 5, 128)]
# The interpreter truncates fp32 -> bf16 instead of rounding to nearest even: up to ~3 ulps apart on CPU.
INTERPRETED_BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def _ids(shapes: list[tuple[int, ...]]) -> list[str]:
    return ["x".join(map(str, s)) for s in shapes]


def _randn(*shape: int, seed: int, scale: float = 1.0, shift: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_rms_norm(assert_close, shape) -> None:
    x, weight = _randn(*shape, seed=0, scale=3), _randn(shape[-1], seed=1, scale=0.1)
    assert_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))


def test_rms_norm_strided_query_half(assert_close) -> None:
    """The query half of ``q_proj``'s ``[T, Hq, 2D]`` output: rows of stride 2D, not D."""
    q_gate = _randn(3, 4, 2 * 24, seed=2)
    query = q_gate[..., :24]
    weight = _randn(24, seed=3, scale=0.1)
    assert_close(rms_norm(query, weight, EPS), reference.rms_norm(query, weight, EPS))


@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_add_rms_norm(assert_close, shape, with_residual) -> None:
    x = _randn(*shape, seed=4)
    residual = _randn(*shape, seed=5, scale=4) if with_residual else None
    weight = _randn(shape[-1], seed=6, scale=0.1)
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, EPS)
    assert_close(new_residual, expected_residual, exact=True, msg="residual")
    assert_close(normed, expected_normed, msg="normed")


def test_add_rms_norm_promotes_like_torch(assert_close) -> None:
    """An fp32 residual stream with a lower-precision ``x``: both outputs in the promoted dtype."""
    x, residual = _randn(4, 40, seed=7, dtype=torch.bfloat16), _randn(4, 40, seed=8)
    weight = _randn(40, seed=9, scale=0.1)
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, EPS)
    assert_close(new_residual, expected_residual, exact=True)
    assert_close(normed, expected_normed)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_gated_rms_norm(assert_close, shape) -> None:
    x, gate = _randn(*shape, seed=10, scale=2), _randn(*shape, seed=11)
    weight = _randn(shape[-1], seed=12, scale=0.1, shift=1.0)
    assert_close(gated_rms_norm(x, gate, weight, EPS), reference.gated_rms_norm(x, gate, weight, EPS))


def test_bfloat16_runs_and_keeps_dtypes(assert_close) -> None:
    x, gate, residual = (_randn(3, 5, 48, seed=s, dtype=torch.bfloat16) for s in (13, 14, 15))
    zero_centred, plain = _randn(48, seed=16, scale=0.1, dtype=torch.bfloat16), _randn(48, seed=17, shift=1.0)
    tol = INTERPRETED_BF16_TOL if DEVICE.type == "cpu" else {}
    assert_close(rms_norm(x, zero_centred, EPS), reference.rms_norm(x, zero_centred, EPS), **tol)
    for actual, expected in zip(
        add_rms_norm(x, residual, zero_centred, EPS), reference.add_rms_norm(x, residual, zero_centred, EPS)
    ):
        assert_close(actual, expected, **tol)
    assert_close(gated_rms_norm(x, gate, plain, EPS), reference.gated_rms_norm(x, gate, plain, EPS), **tol)


def test_empty_rows() -> None:
    x, weight = torch.ones(0, 16, device=DEVICE), torch.zeros(16, device=DEVICE)
    assert rms_norm(x, weight, EPS).shape == (0, 16)
    assert [t.shape for t in add_rms_norm(x, x, weight, EPS)] == [(0, 16), (0, 16)]
    assert gated_rms_norm(x, x, weight, EPS).shape == (0, 16)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 512])
def test_hidden_norms_on_cuda(assert_close, num_tokens, dtype) -> None:
    """Layer norms of Qwen3.5-35B-A3B: hidden 2048, residual stream in the model dtype."""
    x, residual = _randn(num_tokens, 2048, seed=20, dtype=dtype), _randn(num_tokens, 2048, seed=21, dtype=dtype)
    weight = _randn(2048, seed=22, scale=0.1, dtype=dtype)
    assert_close(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS))
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, EPS)
    assert_close(new_residual, expected_residual, exact=True)
    assert_close(normed, expected_normed)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["w_bf16", "w_fp32"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens", [1, 512])
def test_gdn_output_norm_on_cuda(assert_close, num_tokens, dtype, weight_dtype) -> None:
    """GDN output norm of Qwen3.5-35B-A3B: 32 value heads of 128."""
    x, gate = _randn(num_tokens, 32, 128, seed=23, dtype=dtype), _randn(num_tokens, 32, 128, seed=24, dtype=dtype)
    weight = _randn(128, seed=25, scale=0.1, shift=1.0, dtype=weight_dtype)
    assert_close(gated_rms_norm(x, gate, weight, EPS), reference.gated_rms_norm(x, gate, weight, EPS))
