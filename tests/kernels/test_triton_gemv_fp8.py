"""The one-token Triton GEMVs (``kernels.linear.triton_gemv``) with a block-FP8 weight
(``kernels.linear.fp8.Fp8Weight``) against ``kernels.linear.reference``, which dequantizes it and
runs the dense op.

Tolerances: fp32 activations, ``atol=1e-5, rtol=1e-4`` against the reference in fp32 (the
dequantized weight is exact in fp32: an e4m3 value times an fp32 scale, so only the order of the
fp32 sums differs); bf16 activations, ``atol=rtol=3e-2`` against the reference run in fp32 on the
same FP8 weight (one bf16 rounding of the output, and of the prologue's values as the kernel
rounds them). Every mode at ``K`` below one scale block (48, 64), at a multiple of it (256), and
at a partial last block (300); in the launch layouts of ``test_triton_fused_linear``.
"""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear import reference as ref  # noqa: E402
from phloem.kernels.linear import triton_gemv as gemv  # noqa: E402
from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize  # noqa: E402
from phloem.kernels.moe import route_partial  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUTS: dict[str, gemv.GemvConfig | None] = {
    "tuned": None,
    "block_per_program": gemv.GemvConfig(4, 4, 1, 0, False),
    "walk_prefetch": gemv.GemvConfig(2, 4, 1, 1, True),
}
EPS = 1e-6


@pytest.fixture(params=list(LAYOUTS), autouse=True)
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test in every launch layout; and the kernel path never dequantizes the weight (the
    launcher's ``dense`` is only for the shapes it does not cover)."""
    config = LAYOUTS[request.param]
    if config is not None:
        monkeypatch.setattr(gemv, "gemv_config", lambda n, k, conv=False, route=False: config)
    monkeypatch.setattr(gemv, "dense", _no_dense)


def _no_dense(w: object) -> torch.Tensor:
    raise AssertionError("the FP8 GEMV dequantized its weight instead of launching the FP8 kernel")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def _fp8(n: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> Fp8Weight:
    """An ``[n, k]`` weight quantized with one scale per row and 128 columns; rows scaled apart so
    a scale read from the wrong row or block shows."""
    w = _randn(n, k, seed=seed, scale=k**-0.5) * (1 + torch.arange(n, device=DEVICE)[:, None] % 3)
    w[:, 128:256] *= 4.0
    data, scale_inv = fp8_block_quantize(w, (1, 128))
    return Fp8Weight(data, scale_inv, dtype)


def _f32(w: Fp8Weight) -> Fp8Weight:
    return Fp8Weight(w.data, w.scale_inv, torch.float32)


@pytest.mark.parametrize(("n", "k"), [(5, 48), (33, 256), (19, 300)], ids=str)
def test_linear(n: int, k: int, assert_close) -> None:
    x, w = _randn(1, k, seed=n), _fp8(n, k, seed=k)
    assert_close(gemv.linear(x, w), ref.linear(x, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("k", [64, 300])
def test_add_rms_norm_linear(k: int, assert_close) -> None:
    x, res = _randn(1, k, seed=1), _randn(1, k, seed=2)
    norm_w, w = _randn(k, seed=3, scale=0.1), _fp8(37, k, seed=4)
    y, out_res = gemv.add_rms_norm_linear(x, res, norm_w, EPS, w)
    want_y, want_res = ref.add_rms_norm_linear(x, res, norm_w, EPS, w)
    assert_close(y, want_y, atol=1e-5, rtol=1e-4)
    assert_close(out_res, want_res, exact=True)


def test_add_rms_norm_conv_linear(assert_close) -> None:
    hidden, conv_dim, extra, kernel = 300, 24, 11, 4
    x, res = _randn(1, hidden, seed=5), _randn(1, hidden, seed=6)
    norm_w, w = _randn(hidden, seed=7, scale=0.1), _fp8(conv_dim + extra, hidden, seed=8)
    conv_w, states = _randn(conv_dim, kernel, seed=9), _randn(3, conv_dim, kernel - 1, seed=10)
    read, write = torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE)
    want_states = states.clone()
    want_y, want_res = ref.add_rms_norm_conv_linear(x, res, norm_w, EPS, w, conv_w, want_states, read, write)
    y, out_res = gemv.add_rms_norm_conv_linear(x, res, norm_w, EPS, w, conv_w, states, read, write)
    assert_close(y, want_y, atol=1e-5, rtol=1e-4)
    assert_close(out_res, want_res, exact=True)
    assert_close(states, want_states, atol=1e-5, rtol=1e-4, msg="conv state")


def test_gated_rms_norm_linear(assert_close) -> None:
    heads, head_dim = 4, 64  # K = 256: two scale blocks of two heads each
    x, gate = _randn(1, heads, head_dim, seed=11), _randn(1, heads, head_dim, seed=12)
    norm_w, w = 1 + _randn(head_dim, seed=13, scale=0.1), _fp8(29, heads * head_dim, seed=14)
    got = gemv.gated_rms_norm_linear(x, gate, norm_w, EPS, w)
    assert_close(got, ref.gated_rms_norm_linear(x, gate, norm_w, EPS, w), atol=1e-5, rtol=1e-4)


def test_sigmoid_gate_linear(assert_close) -> None:
    x, gate, w = _randn(1, 300, seed=15), _randn(1, 300, seed=16), _fp8(18, 300, seed=17)
    assert_close(gemv.sigmoid_gate_linear(x, gate, w), ref.sigmoid_gate_linear(x, gate, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prologue", ["gated", "sigmoid"])
def test_route_epilogue(prologue: str, assert_close) -> None:
    """``*_linear_route``: ``s`` and the router's partial logits (the accumulator, fp32 terms
    truncated per program in the kernel, per row in the reference)."""
    n, heads, d, cols = 36, 4, 64, 7
    x, z, gate = _randn(1, heads, d, seed=20), _randn(1, heads, d, seed=21), _randn(1, heads * d, seed=22)
    norm_w, w = _randn(d, seed=23, scale=0.1) + 1.0, _fp8(n, heads * d, seed=24)
    res, router_t, post_w = _randn(1, n, seed=25), _randn(n, cols, seed=26, scale=0.3), _randn(n, seed=27, scale=0.1)
    accs = [route_partial.new_route_acc(cols, DEVICE) for _ in range(2)]
    outs = []
    for impl, acc in zip((gemv, ref), accs):
        if prologue == "gated":
            outs.append(impl.gated_rms_norm_linear_route(x, z, norm_w, EPS, w, res, router_t, post_w, acc))
        else:
            outs.append(impl.sigmoid_gate_linear_route(x.reshape(1, -1), gate, w, res, router_t, post_w, acc))
    assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    got, want = (a.sum(0).double() / route_partial.ROUTE_SCALE for a in accs)
    assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_add_rms_norm_router(assert_close) -> None:
    x, res = _randn(1, 64, seed=30), _randn(1, 64, seed=31)
    norm_w, router = _randn(64, seed=32, scale=0.1), _fp8(13, 64, seed=33)
    for name, g, e in zip(("logits", "normed", "residual"), gemv.add_rms_norm_router(x, res, norm_w, EPS, router),
                          ref.add_rms_norm_router(x, res, norm_w, EPS, router), strict=True):  # fmt: skip
        assert_close(g, e, atol=1e-5, rtol=1e-4, msg=name)


def test_bf16_activations_against_the_fp32_reference(assert_close) -> None:
    bf = torch.bfloat16
    x, res = _randn(1, 300, dtype=bf, seed=40), _randn(1, 300, dtype=bf, seed=41)
    norm_w, w = _randn(300, dtype=bf, seed=42, scale=0.1), _fp8(20, 300, seed=43, dtype=bf)
    y, _ = gemv.add_rms_norm_linear(x, res, norm_w, EPS, w)
    assert y.dtype == bf
    want, _ = ref.add_rms_norm_linear(x.float(), res.float(), norm_w.float(), EPS, _f32(w))
    assert_close(y.float(), want, atol=3e-2, rtol=3e-2)


def test_shapes_it_does_not_cover_dequantize(assert_close, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rows take the unfused ops on the dequantized weight, the reference's values."""
    from phloem.kernels.linear.fp8 import dense

    monkeypatch.setattr(gemv, "dense", dense)
    x, res = _randn(3, 64, seed=50), _randn(3, 64, seed=51)
    norm_w, w = _randn(64, seed=52, scale=0.1), _fp8(9, 64, seed=53)
    got = gemv.add_rms_norm_linear(x, res, norm_w, EPS, w)
    want = ref.add_rms_norm_linear(x, res, norm_w, EPS, w)
    assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    assert_close(gemv.linear(x, w), ref.linear(x, w), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("n", "k"), [(9216, 2048), (2048, 4096)], ids=["qkv_proj", "o_proj"])
def test_real_shapes_on_the_gpu(n: int, k: int) -> None:
    """The 35B-A3B projections Qwen's FP8 release quantizes, bf16 activations, against the fp32
    reference on the same FP8 weight (relative error of the whole row)."""
    bf = torch.bfloat16
    x, res, nw = _randn(1, k, dtype=bf, seed=1), _randn(1, k, dtype=bf, seed=2), _randn(k, dtype=bf, seed=3, scale=0.1)
    w = _fp8(n, k, seed=4, dtype=bf)

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want).norm() / want.norm())

    assert rel(gemv.linear(x, w), ref.linear(x.float(), _f32(w))) < 1e-2
    got, _ = gemv.add_rms_norm_linear(x, res, nw, EPS, w)
    assert rel(got, ref.add_rms_norm_linear(x.float(), res.float(), nw.float(), EPS, _f32(w))[0]) < 1e-2
