"""The one-token Triton GEMVs (``kernels.linear.triton_gemv``) against the references of ``kernels.linear.reference``.

On CPU under the interpreter at small shapes, in every launch layout (one program per row block;
programs walking several blocks, with and without the one-block-ahead prefetch); on the GPU at the
35B-A3B shapes (marker ``gpu``).
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
from phloem.kernels.linear.reference import linear as ref_linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUTS: dict[str, gemv.GemvConfig | None] = {
    "tuned": None,  # gemv_config's own choice
    "block_per_program": gemv.GemvConfig(4, 4, 1, 0, False),
    "walk": gemv.GemvConfig(2, 4, 1, 1, False),
    "walk_prefetch": gemv.GemvConfig(2, 4, 1, 1, True),
    "one_row_prefetch": gemv.GemvConfig(1, 2, 1, 2, True),
}


@pytest.fixture(params=list(LAYOUTS), autouse=True)
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> gemv.GemvConfig | None:
    """Every test runs in every launch layout (the fused ops take their config from ``gemv_config``)."""
    config = LAYOUTS[request.param]
    if config is not None:
        monkeypatch.setattr(gemv, "gemv_config", lambda n, k, conv=False, route=False: config)
    return config


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 7), (33, 64), (130, 300)], ids=str)
def test_linear(n: int, k: int, assert_close) -> None:
    x, w = _randn(1, k, seed=n), _randn(n, k, seed=k, scale=k**-0.5)
    assert_close(gemv.linear(x, w), ref_linear(x, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
def test_add_rms_norm_linear(with_residual: bool, assert_close) -> None:
    x, res = _randn(1, 48, seed=1), _randn(1, 48, seed=2) if with_residual else None
    norm_w, w = _randn(48, seed=3, scale=0.1), _randn(37, 48, seed=4, scale=0.2)
    y, out_res = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    want_y, want_res = ref.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    assert_close(y, want_y, atol=1e-5, rtol=1e-4)
    assert_close(out_res, want_res, exact=True)


@pytest.mark.parametrize("max_conv_blocks", [16, 0], ids=["conv_preloaded_after_walk_kept", "conv_per_block"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "copy_on_write"])
def test_add_rms_norm_conv_linear(in_place: bool, max_conv_blocks: int, assert_close, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways the conv update runs (after the walk from the kept projections, or block by block
    inside a walk too long to preload: ``gemv._MAX_CONV_BLOCKS``); each program walks several blocks
    of conv rows (two programs on the interpreter), so a kept projection taken from the wrong block
    would show."""
    monkeypatch.setattr(gemv, "_MAX_CONV_BLOCKS", max_conv_blocks)
    hidden, conv_dim, extra, kernel = 40, 24, 11, 4  # rows past the conv channels: z | b | a
    x, res = _randn(1, hidden, seed=5), _randn(1, hidden, seed=6)
    norm_w, w = _randn(hidden, seed=7, scale=0.1), _randn(conv_dim + extra, hidden, seed=8, scale=0.3)
    conv_w = _randn(conv_dim, kernel, seed=9)
    states = _randn(3, conv_dim, kernel - 1, seed=10)
    read = torch.tensor([1], device=DEVICE)
    write = read.clone() if in_place else torch.tensor([2], device=DEVICE)
    want_states = states.clone()
    want_y, want_res = ref.add_rms_norm_conv_linear(x, res, norm_w, 1e-6, w, conv_w, want_states, read, write)
    y, out_res = gemv.add_rms_norm_conv_linear(x, res, norm_w, 1e-6, w, conv_w, states, read, write)
    assert_close(y, want_y, atol=1e-5, rtol=1e-4)
    assert_close(out_res, want_res, exact=True)
    assert_close(states, want_states, atol=1e-5, rtol=1e-4, msg="conv state")


def test_gated_rms_norm_linear_reads_a_strided_gate(assert_close) -> None:
    heads, head_dim = 3, 16
    x = _randn(1, heads, head_dim, seed=11)
    # The gate is a slice of the GDN input projection's output row, as in the model.
    proj = _randn(1, 5 + heads * head_dim + 7, seed=12)
    gate = proj[:, 5 : 5 + heads * head_dim].view(1, heads, head_dim)
    norm_w, w = 1 + _randn(head_dim, seed=13, scale=0.1), _randn(29, heads * head_dim, seed=14, scale=0.2)
    assert_close(gemv.gated_rms_norm_linear(x, gate, norm_w, 1e-6, w), ref.gated_rms_norm_linear(x, gate, norm_w, 1e-6, w),
                 atol=1e-5, rtol=1e-4)  # fmt: skip


def test_sigmoid_gate_linear(assert_close) -> None:
    x, gate, w = _randn(1, 64, seed=15), _randn(1, 64, seed=16), _randn(18, 64, seed=17, scale=0.2)
    assert_close(gemv.sigmoid_gate_linear(x, gate, w), ref.sigmoid_gate_linear(x, gate, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prologue", ["gated", "sigmoid"])
def test_route_epilogue_adds_the_residual_and_the_routers_terms(prologue: str, assert_close) -> None:
    """``*_linear_route`` (kernels/moe/route_partial.py) in every layout: ``s`` as the plain projection
    plus the residual, the accumulator as the reference's (fp32; the kernel truncates each
    program's part, the reference the whole row's)."""
    from phloem.kernels.moe import route_partial

    n, heads, d, cols = 36, 4, 16, 7
    x, z, gate = _randn(1, heads, d, seed=20), _randn(1, heads, d, seed=21), _randn(1, heads * d, seed=22)
    norm_w, w = _randn(d, seed=23, scale=0.1) + 1.0, _randn(n, heads * d, seed=24, scale=0.2)
    res, router_t, post_w = _randn(1, n, seed=25), _randn(n, cols, seed=26, scale=0.3), _randn(n, seed=27, scale=0.1)
    accs = [route_partial.new_route_acc(cols, DEVICE) for _ in range(2)]
    outs = []
    for impl, acc in zip((gemv, ref), accs):
        if prologue == "gated":
            outs.append(impl.gated_rms_norm_linear_route(x, z, norm_w, 1e-6, w, res, router_t, post_w, acc))
        else:
            outs.append(impl.sigmoid_gate_linear_route(x.reshape(1, -1), gate, w, res, router_t, post_w, acc))
    assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    got, want = (a.sum(0).double() / route_partial.ROUTE_SCALE for a in accs)
    assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
def test_add_rms_norm_router_writes_the_normed_row(with_residual: bool, assert_close) -> None:
    x, res = _randn(1, 32, seed=20), _randn(1, 32, seed=30) if with_residual else None
    norm_w, router = _randn(32, seed=21, scale=0.1), _randn(13, 32, seed=22)
    got = gemv.add_rms_norm_router(x, res, norm_w, 1e-6, router)
    want = ref.add_rms_norm_router(x, res, norm_w, 1e-6, router)
    for name, g, e in zip(("logits", "normed", "residual"), got, want, strict=True):
        assert_close(g, e, atol=1e-5, rtol=1e-4, msg=name)


def test_bf16_rounds_like_the_reference(assert_close) -> None:
    x, res = _randn(1, 64, dtype=torch.bfloat16, seed=40), _randn(1, 64, dtype=torch.bfloat16, seed=41)
    norm_w, w = _randn(64, dtype=torch.bfloat16, seed=42, scale=0.1), _randn(20, 64, dtype=torch.bfloat16, seed=43, scale=0.2)
    y, out_res = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    want_y, want_res = ref.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: an ulp or two on CPU.
    exact = DEVICE.type == "cuda"
    assert_close(out_res, want_res, exact=exact, atol=None if exact else 1.6e-2)
    assert_close(y, want_y, atol=3e-2, rtol=3e-2)


def test_shapes_it_does_not_cover_take_the_unfused_ops(assert_close) -> None:
    x, res = _randn(3, 32, seed=50), _randn(3, 32, seed=51)  # three rows
    norm_w, w = _randn(32, seed=52, scale=0.1), _randn(9, 32, seed=53)
    got = gemv.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    want = ref.add_rms_norm_linear(x, res, norm_w, 1e-6, w)
    assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    router = _randn(9, 32, seed=54)
    for g, e in zip(gemv.add_rms_norm_router(x, res, norm_w, 1e-6, router), ref.add_rms_norm_router(x, res, norm_w, 1e-6, router),
                    strict=True):  # fmt: skip
        assert_close(g, e, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_shapes_on_the_gpu() -> None:
    """The 35B-A3B decode projections in bf16 against fp32 references, in every launch layout."""
    bf = torch.bfloat16

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want.float()).norm() / want.float().norm())

    x, res = _randn(1, 2048, dtype=bf, seed=1), _randn(1, 2048, dtype=bf, seed=2)
    nw = _randn(2048, dtype=bf, seed=3, scale=0.1)
    w_in = _randn(12352, 2048, dtype=bf, seed=4, scale=2048**-0.5)
    conv_w, states = _randn(8192, 4, dtype=bf, seed=5), _randn(4, 8192, 3, dtype=bf, seed=6)
    slots = torch.tensor([2], device=DEVICE)
    f32 = lambda *t: [a.float() for a in t]  # noqa: E731
    want_states = states.float()
    want, _ = ref.add_rms_norm_conv_linear(*f32(x, res, nw), 1e-6, *f32(w_in, conv_w), want_states, slots, slots)
    got, _ = gemv.add_rms_norm_conv_linear(x, res, nw, 1e-6, w_in, conv_w, states, slots, slots)
    assert rel(got, want) < 1e-2 and rel(states, want_states) < 1e-2
    v, z = _randn(1, 32, 128, dtype=bf, seed=7), _randn(1, 32, 128, dtype=bf, seed=8)
    gw, w_out = 1 + _randn(128, dtype=bf, seed=9, scale=0.1), _randn(2048, 4096, dtype=bf, seed=10, scale=4096**-0.5)
    assert rel(gemv.gated_rms_norm_linear(v, z, gw, 1e-6, w_out), ref.gated_rms_norm_linear(*f32(v, z, gw), 1e-6, w_out.float())) < 1e-2
    g = _randn(1, 4096, dtype=bf, seed=11)
    assert rel(gemv.sigmoid_gate_linear(v.view(1, -1), g, w_out), ref.sigmoid_gate_linear(*f32(v.view(1, -1), g, w_out))) < 1e-2
    router = _randn(257, 2048, dtype=bf, seed=12, scale=2048**-0.5)
    for a, b in zip(gemv.add_rms_norm_router(x, res, nw, 1e-6, router), ref.add_rms_norm_router(*f32(x, res, nw), 1e-6, router.float())):
        assert rel(a, b) < 1e-2
