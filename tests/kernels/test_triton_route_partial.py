"""The MoE router folded into the output projection before it (``kernels/moe/route_partial.py``): the
Triton projections' route epilogue and the experts' kernel that reads the accumulator, against the
torch references (interpreter on CPU; the real shapes on the GPU)."""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear import reference as fused_linear  # noqa: E402
from phloem.kernels.linear import triton_gemv as gemv  # noqa: E402
from phloem.kernels.moe import route_partial  # noqa: E402
from phloem.kernels.moe import triton_decode as fused_moe  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def _layer(hidden: int, heads: int, head_dim: int, experts: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    router = rand(experts + 1, hidden, scale=hidden**-0.5)
    return dict(
        x=rand(1, heads, head_dim), z=rand(1, heads, head_dim), gate=rand(1, heads * head_dim),
        norm_w=(torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype),
        weight=rand(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5), residual=rand(1, hidden),
        router=router, router_t=router.t().contiguous(), post_w=rand(hidden, scale=0.1),
    )  # fmt: skip


def _project(impl: object, prologue: str, t: dict[str, torch.Tensor], acc: torch.Tensor) -> torch.Tensor:
    route = (t["residual"], t["router_t"], t["post_w"], acc)
    if prologue == "gated":
        out: torch.Tensor = impl.gated_rms_norm_linear_route(t["x"], t["z"], t["norm_w"], EPS, t["weight"], *route)  # type: ignore[attr-defined]
    else:
        flat = t["x"].reshape(1, -1)
        out = impl.sigmoid_gate_linear_route(flat, t["gate"], t["weight"], *route)  # type: ignore[attr-defined]
    return out


def _u(s: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The router's partial logits of ``s``, in fp64 (what the accumulator holds, to its resolution)."""
    return ((s.double() * (1.0 + t["post_w"].double())) @ t["router_t"].double())[0]


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("prologue", ["gated", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_projection_adds_the_residual_and_the_routers_terms(prologue: str, dtype: torch.dtype, assert_close) -> None:
    # 96 rows of 8 over the CPU's 8 programs: every accumulator row is added into, some twice.
    t = _layer(hidden=96, heads=4, head_dim=16, experts=12, dtype=dtype, seed=1)
    acc = route_partial.new_route_acc(13, DEVICE)
    assert acc.shape == (route_partial.ROUTE_COPIES, 13)
    s = _project(gemv, prologue, t, acc)
    assert s.shape == (1, 96) and s.dtype == dtype
    plain = (gemv.gated_rms_norm_linear(t["x"], t["z"], t["norm_w"], EPS, t["weight"]) if prologue == "gated"
             else gemv.sigmoid_gate_linear(t["x"].reshape(1, -1), t["gate"], t["weight"]))  # fmt: skip
    # The kernel's own projection plus the residual (on the GPU to the bit; the interpreter
    # truncates where torch rounds: a bf16 ulp).
    tol = 0.0 if dtype == torch.float32 or DEVICE.type == "cuda" else 1e-2
    assert_close(s, plain + t["residual"], atol=tol, rtol=tol)
    assert (acc != 0).all(dim=1).sum() >= 2, "the programs' sums spread over the accumulator's rows"
    assert_close(acc.sum(0).double() / route_partial.ROUTE_SCALE, _u(s, t), atol=1e-5, rtol=1e-5)
    # Against the reference composition (fused_linear), from its own s.
    ref_acc = route_partial.new_route_acc(13, DEVICE)
    ref_s = _project(fused_linear, prologue, t, ref_acc)
    assert_close(s, ref_s, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert_close(ref_acc.sum(0).double() / route_partial.ROUTE_SCALE, _u(ref_s, t), atol=1e-5, rtol=1e-5)


def test_operands_the_kernel_cannot_take_go_to_the_reference(assert_close) -> None:
    """A transposed view of the router (not contiguous): the reference epilogue after the plain
    projection, the same values to fp32 rounding, everything in the accumulator's first row."""
    t = _layer(hidden=32, heads=2, head_dim=16, experts=6, dtype=torch.float32, seed=2)
    expected_acc = route_partial.new_route_acc(7, DEVICE)
    expected = _project(fused_linear, "gated", t, expected_acc)
    t["router_t"] = t["router"].t()
    acc = route_partial.new_route_acc(7, DEVICE)
    assert_close(_project(gemv, "gated", t, acc), expected, atol=1e-5, rtol=1e-5)
    assert not acc[1:].any()
    assert_close(acc.double() / route_partial.ROUTE_SCALE, expected_acc.double() / route_partial.ROUTE_SCALE, atol=1e-5, rtol=1e-5)


def test_the_logits_are_the_routers_to_one_rounding(assert_close) -> None:
    """``rstd(s) · u`` against the unfused router (``add_rms_norm_router``): fp32 to its rounding."""
    t = _layer(hidden=64, heads=4, head_dim=16, experts=10, dtype=torch.float32, seed=3)
    acc = route_partial.new_route_acc(11, DEVICE)
    s = _project(gemv, "sigmoid", t, acc)
    logits, normed, res = fused_linear.add_rms_norm_router(s, None, t["post_w"], EPS, t["router"])
    rstd = torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert_close(route_partial.route_logits(acc, rstd, torch.float32), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_experts_read_the_accumulator_and_zero_it(dtype: torch.dtype, assert_close) -> None:
    hidden, experts, inter, top_k = 64, 8, 32, 3
    t = _layer(hidden=hidden, heads=4, head_dim=16, experts=experts, dtype=dtype, seed=4)
    acc = route_partial.new_route_acc(experts + 1, DEVICE)
    s = _project(gemv, "gated", t, acc)
    gen = torch.Generator().manual_seed(5)
    w_gate_up = (torch.randn(experts + 1, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts + 1, hidden, inter, generator=gen) * inter**-0.5).to(DEVICE, dtype)
    ref_acc = acc.clone()
    expected = route_partial.fused_moe_route_partial(s, ref_acc, t["post_w"], EPS, w_gate_up, w_down, top_k, True)
    out = fused_moe.fused_moe_token_route_partial(s, acc, t["post_w"], EPS, w_gate_up, w_down, top_k, True)
    assert not acc.any() and not ref_acc.any(), "both zero the accumulator after reading it"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("prologue", ["gated", "sigmoid"])
def test_real_shapes_give_the_same_bits_every_run(prologue: str, assert_close) -> None:
    """The 35B-A3B shapes (out_proj / o_proj 2048 x 4096, 257 router rows, 512 programs): the
    fixed-point sums are the same bits in every run whatever order the programs finish in, and
    within fp32 of the fp64 sum; s is the plain projection plus the residual, to the bit."""
    t = _layer(hidden=2048, heads=32, head_dim=128, experts=256, dtype=torch.bfloat16, seed=6)
    if prologue == "sigmoid":
        t = _layer(hidden=2048, heads=16, head_dim=256, experts=256, dtype=torch.bfloat16, seed=6)
    runs = []
    for _ in range(10):
        acc = route_partial.new_route_acc(257, DEVICE)
        s = _project(gemv, prologue, t, acc)
        runs.append(acc)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    plain = (gemv.gated_rms_norm_linear(t["x"], t["z"], t["norm_w"], EPS, t["weight"]) if prologue == "gated"
             else gemv.sigmoid_gate_linear(t["x"].reshape(1, -1), t["gate"], t["weight"]))  # fmt: skip
    assert torch.equal(s, plain + t["residual"])
    assert_close(runs[0].sum(0).double() / route_partial.ROUTE_SCALE, _u(s, t), atol=1e-4, rtol=1e-5)


def test_the_kernels_take_only_accumulators_of_the_format() -> None:
    """``acc_fits``: ROUTE_COPIES contiguous int64 rows of E + 1 columns; anything else goes to the
    references."""
    acc = route_partial.new_route_acc(9, DEVICE)
    assert route_partial.acc_fits(acc, 9)
    assert not route_partial.acc_fits(acc, 7) and not route_partial.acc_fits(acc, 8)  # another width
    assert not route_partial.acc_fits(acc.to(torch.int32), 9)
    assert not route_partial.acc_fits(acc[:1], 9)  # too few rows
    assert not route_partial.acc_fits(torch.zeros(9, route_partial.ROUTE_COPIES, dtype=torch.int64).t(), 9)  # strided
