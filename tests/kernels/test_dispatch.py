from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.config import KernelConfig  # noqa: E402
from phloem.kernels.dispatch import KernelOps, get_ops  # noqa: E402
from phloem.kernels.norm import reference as norm  # noqa: E402
from phloem.runtime.env import kernel_config  # noqa: E402

ENV_VAR = "PHLOEM_KERNELS"
OP_NAMES = [f.name for f in dataclasses.fields(KernelOps) if f.name not in ("backend", "fused_decode", "route_partial", "pdl", "fp8_w8a8")]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_cpu_defaults_to_the_references() -> None:
    ops = get_ops(CPU)
    assert ops.backend == "torch"
    assert ops.rms_norm is norm.rms_norm
    assert all(getattr(ops, name).__module__.startswith("phloem.kernels.") for name in OP_NAMES)
    assert not any(".triton." in getattr(ops, name).__module__ for name in OP_NAMES)


def test_cuda_defaults_to_triton() -> None:
    """Choosing needs no GPU: a ``cuda`` device object is enough."""
    ops = get_ops(CUDA)
    assert ops.backend == "triton"
    assert ops.rms_norm.__module__ == "phloem.kernels.norm.triton_norm"
    assert ops.paged_attention is get_ops(CPU).paged_attention


def test_fp8_w8a8_linear_is_the_reference_or_the_gemm_and_off_by_default() -> None:
    from phloem.kernels.linear import w8a8

    assert not get_ops(CPU).fp8_w8a8 and get_ops(CPU, KernelConfig(fp8_w8a8=True)).fp8_w8a8
    assert get_ops(CPU).fp8_w8a8_linear is w8a8.fp8_w8a8_block_matmul_reference
    assert get_ops(CUDA).fp8_w8a8_linear.__module__ == "phloem.kernels.linear.triton_w8a8"


def test_fp8_w8a8_grouped_linear_is_the_reference_or_the_grouped_gemm() -> None:
    """The experts' W8A8 projection (``engine.models._moe.fused_moe_w8a8``) in both tables."""
    from phloem.kernels.moe import w8a8

    assert get_ops(CPU).fp8_w8a8_grouped_linear is w8a8.fp8_w8a8_grouped_linear_reference
    assert get_ops(CPU, KernelConfig(backend="torch")).fp8_w8a8_grouped_linear is w8a8.fp8_w8a8_grouped_linear_reference
    triton_op = get_ops(CUDA).fp8_w8a8_grouped_linear
    assert triton_op.__module__ == "phloem.kernels.moe.triton_grouped_w8a8"
    assert triton_op.__name__ == "fp8_w8a8_grouped_linear"


def test_env_forces_torch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "torch")
    assert get_ops(CUDA, kernel_config()) == get_ops(CPU, kernel_config())


def test_env_forces_triton_under_the_interpreter(monkeypatch: pytest.MonkeyPatch, assert_close) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ops = get_ops(CPU, kernel_config())
    assert ops.backend == "triton"
    if not torch.cuda.is_available():
        x, weight = torch.randn(3, 16), torch.randn(16) * 0.1
        assert_close(ops.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6))


def test_env_triton_on_cpu_without_interpreter_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_ops(CPU, kernel_config())


def test_bad_env_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be"):
        get_ops(CPU, kernel_config())


def test_a_bad_backend_in_the_config_raises() -> None:
    with pytest.raises(ValueError, match="kernel backend must be"):
        KernelConfig(backend="cuda")  # type: ignore[arg-type]


def test_ops_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_ops(CPU).rms_norm = norm.add_rms_norm  # type: ignore[misc]


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("name", OP_NAMES)
def test_triton_ops_keep_the_reference_signature(name: str, pdl: bool) -> None:
    reference, triton_op = getattr(get_ops(CPU), name), getattr(get_ops(CUDA, KernelConfig(pdl=pdl)), name)
    assert inspect.signature(triton_op) == inspect.signature(reference)


def test_the_triton_gemv_serves_linear_unless_turned_off() -> None:
    """The one-token Triton GEMV by default on the Triton backend; ``triton_gemv=False``: cuBLAS."""
    assert get_ops(CUDA).linear.__module__ == "phloem.kernels.linear.triton_gemv"
    assert get_ops(CPU).linear.__module__ == "phloem.kernels.linear.reference"  # the torch backend ignores it
    off = KernelConfig(triton_gemv=False)
    assert get_ops(CUDA, off).linear is get_ops(CPU, off).linear


def test_fused_decode_is_on_unless_turned_off() -> None:
    assert get_ops(CPU).fused_decode and get_ops(CUDA).fused_decode
    off = KernelConfig(fused_decode=False)
    assert not get_ops(CPU, off).fused_decode and not get_ops(CUDA, off).fused_decode


def test_the_router_goes_into_the_projection_with_the_fused_path() -> None:
    """``KernelOps.route_partial`` (kernels/moe/route_partial.py) rides on the fused one-token path:
    off with ``fused_decode=False``."""
    assert get_ops(CPU).route_partial and get_ops(CUDA).route_partial
    assert not get_ops(CPU, KernelConfig(fused_decode=False)).route_partial


def test_pdl_is_bound_into_the_triton_ops() -> None:
    """``KernelConfig.pdl`` reaches every Triton launcher through the table; never under the
    interpreter, and never on the torch backend."""
    import triton

    on = get_ops(CUDA, KernelConfig(pdl=True))
    assert on.pdl == (not triton.knobs.runtime.interpret)
    assert on.linear.keywords == {"pdl": on.pdl}  # type: ignore[attr-defined]
    assert not get_ops(CUDA, KernelConfig(pdl=False)).pdl and not get_ops(CPU, KernelConfig(pdl=True)).pdl
