from __future__ import annotations

from types import ModuleType

import pytest
import torch

from phloem.kernels.norm.reference import add_rms_norm, gated_rms_norm, rms_norm

SHAPES = [(1, 1), (1, 8), (7, 33), (3, 5, 128)]
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _ids(shapes: list[tuple[int, ...]]) -> list[str]:
    return ["x".join(map(str, s)) for s in shapes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_rms_norm_matches_hf(hf_qwen3_next: ModuleType, assert_close, shape, dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype)
    ref = hf_qwen3_next.Qwen3NextRMSNorm(shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(shape[-1]) * 0.1)
        expected = ref(x)
    assert_close(rms_norm(x, ref.weight.detach(), EPS), expected, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
def test_add_rms_norm(assert_close, with_residual, dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 24).to(dtype)
    residual = torch.randn(5, 24).to(dtype) if with_residual else None
    weight = (torch.randn(24) * 0.1).to(dtype)
    normed, new_residual = add_rms_norm(x, residual, weight, EPS)
    expected_residual = x if residual is None else x + residual
    assert_close(new_residual, expected_residual, exact=True)
    assert_close(normed, rms_norm(expected_residual, weight, EPS), exact=True)
    assert new_residual.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids(SHAPES))
def test_gated_rms_norm_matches_hf(hf_qwen3_next: ModuleType, assert_close, shape, dtype) -> None:
    torch.manual_seed(2)
    x, gate = (torch.randn(shape) * 2).to(dtype), torch.randn(shape).to(dtype)
    ref = hf_qwen3_next.Qwen3NextRMSNormGated(shape[-1], eps=EPS).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + torch.randn(shape[-1]) * 0.1)
        expected = ref(x, gate)
    assert_close(gated_rms_norm(x, gate, ref.weight.detach(), EPS), expected, exact=True)
