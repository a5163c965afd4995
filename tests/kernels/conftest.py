"""Kernel test fixtures: one tolerance-aware comparison, NaN-filled scratch and the HF reference ops."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import torch

# (atol, rtol) per dtype of the tensor under test.
_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

AssertClose = Callable[..., None]


def _assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    exact: bool = False,
    msg: str = "",
) -> None:
    """Elementwise ``|a - e| <= atol + rtol * |e|``; the failure reports max-abs and relative error.

    Relative error is ``max|a - e| / max|e|``. ``exact=True`` demands bitwise equality (copies, scatters).
    """
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    default_atol, default_rtol = _TOLERANCES.get(actual.dtype, (0.0, 0.0))
    atol = 0.0 if exact else (default_atol if atol is None else atol)
    rtol = 0.0 if exact else (default_rtol if rtol is None else rtol)
    if exact and torch.equal(actual, expected):
        return
    a, e = actual.double(), expected.double()
    close = torch.isclose(a, e, rtol=rtol, atol=atol)
    if bool(close.all()):
        return
    diff = (a - e).abs().nan_to_num(nan=float("inf"))
    max_abs = diff.max().item() if diff.numel() else 0.0
    rel = max_abs / max(e.abs().max().item() if e.numel() else 0.0, 1e-30)
    num_bad = int((~close).sum())
    raise AssertionError(
        f"{msg}: {num_bad}/{close.numel()} elements differ; max_abs={max_abs:.3e} rel={rel:.3e} "
        f"(dtype={actual.dtype}, atol={atol:.1e}, rtol={rtol:.1e}, exact={exact})"
    )


@pytest.fixture
def assert_close() -> AssertClose:
    return _assert_close


@pytest.fixture(autouse=True)
def nan_filled_empty(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Floating ``torch.empty`` / ``torch.empty_like`` return NaN, so reads of unwritten scratch show up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    yield


@pytest.fixture(scope="session")
def hf_qwen3_next() -> ModuleType:
    """HF's ``modeling_qwen3_next`` on its pure-torch paths."""
    # The fla / causal-conv1d packages are CUDA kernels; a None entry makes transformers fall back to torch.
    sys.modules["fla"] = None  # type: ignore[assignment]
    sys.modules["causal_conv1d"] = None  # type: ignore[assignment]
    from transformers.models.qwen3_next import modeling_qwen3_next

    return modeling_qwen3_next


@pytest.fixture(params=[1], ids=["tile0-preloaded"])
def decode_preload(request: pytest.FixtureRequest) -> int:
    """The split-KV decode attention as it launches: the one-tile splits' keys loaded before
    ``gdc_wait`` (``PRELOAD``; its other modes were removed, ``docs/decisions.md``)."""
    return int(request.param)
