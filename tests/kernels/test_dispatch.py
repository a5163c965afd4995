from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels import norm  # noqa: E402
from phloem.kernels.dispatch import ENV_VAR, KernelOps, get_ops  # noqa: E402

OP_NAMES = [f.name for f in dataclasses.fields(KernelOps) if f.name not in ("backend", "fused_decode", "route_partial")]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_defaults_to_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    ops = get_ops(CPU)
    assert ops.backend == "torch"
    assert ops.rms_norm is norm.rms_norm
    assert all(getattr(ops, name).__module__.startswith("phloem.kernels.") for name in OP_NAMES)
    assert not any(".triton." in getattr(ops, name).__module__ for name in OP_NAMES)


def test_cuda_defaults_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing needs no GPU: a ``cuda`` device object is enough."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    ops = get_ops(CUDA)
    assert ops.backend == "triton"
    assert ops.rms_norm.__module__ == "phloem.kernels.triton.norm"
    assert ops.paged_attention is get_ops(CPU).paged_attention


def test_env_forces_torch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_ops(CUDA) == get_ops(CPU)


def test_env_forces_triton_under_the_interpreter(monkeypatch: pytest.MonkeyPatch, assert_close) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = get_ops(CPU)
    assert ops.backend == "triton"
    if not torch.cuda.is_available():
        x, weight = torch.randn(3, 16), torch.randn(16) * 0.1
        assert_close(ops.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


def test_env_triton_on_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_ops(CPU)


def test_bad_env_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be"):
        get_ops(CPU)


def test_ops_are_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_ops(CPU).rms_norm = norm.add_rms_norm  # type: ignore[misc]


@pytest.mark.parametrize("name", OP_NAMES)
def test_triton_ops_keep_the_reference_signature(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    reference, triton_op = getattr(get_ops(CPU), name), getattr(get_ops(CUDA), name)
    assert inspect.signature(triton_op) == inspect.signature(reference)


def test_the_triton_gemv_serves_linear_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-token Triton GEMV by default on the Triton backend; ``PHLOEM_TRITON_GEMV=0``: cuBLAS."""
    from phloem.kernels.dispatch import GEMV_ENV_VAR

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(GEMV_ENV_VAR, raising=False)
    assert get_ops(CUDA).linear.__module__ == "phloem.kernels.triton.gemv"
    assert get_ops(CPU).linear.__module__ == "phloem.kernels.linear"  # the torch backend ignores it
    monkeypatch.setenv(GEMV_ENV_VAR, "0")
    assert get_ops(CUDA).linear is get_ops(CPU).linear


def test_fused_decode_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from phloem.kernels.dispatch import FUSED_DECODE_ENV_VAR

    monkeypatch.delenv(FUSED_DECODE_ENV_VAR, raising=False)
    assert get_ops(CPU).fused_decode and get_ops(CUDA).fused_decode
    monkeypatch.setenv(FUSED_DECODE_ENV_VAR, "0")
    assert not get_ops(CPU).fused_decode and not get_ops(CUDA).fused_decode


def test_the_router_goes_into_the_projection_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KernelOps.route_partial`` (kernels/route_partial.py) rides on the fused one-token path:
    off with ``PHLOEM_ROUTE_PARTIAL=0`` and with ``PHLOEM_FUSED_DECODE=0``."""
    from phloem.kernels.dispatch import FUSED_DECODE_ENV_VAR, ROUTE_PARTIAL_ENV_VAR

    monkeypatch.delenv(FUSED_DECODE_ENV_VAR, raising=False)
    monkeypatch.delenv(ROUTE_PARTIAL_ENV_VAR, raising=False)
    assert get_ops(CPU).route_partial and get_ops(CUDA).route_partial
    monkeypatch.setenv(ROUTE_PARTIAL_ENV_VAR, "0")
    assert not get_ops(CPU).route_partial and not get_ops(CUDA).route_partial
    monkeypatch.delenv(ROUTE_PARTIAL_ENV_VAR)
    monkeypatch.setenv(FUSED_DECODE_ENV_VAR, "0")
    assert not get_ops(CPU).route_partial
