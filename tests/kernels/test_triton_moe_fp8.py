"""Block-FP8 expert weights (``kernels.linear.fp8.Fp8Weight``) in the MoE kernels against the torch
references on the same ``Fp8Weight`` (``kernels.moe.reference``, which dequantizes only the experts
a batch selected).

Weights are quantized per row and 128-column block (``fp8_block_quantize(w, (1, 128))``, the
model's layout) at ``H = 200`` and ``I = 136``: neither is a multiple of 128, so the last scale
block of every row is partial, and the tiles are both wider than one block (the scales broadcast
over 128-column groups, ``triton_fp8.dequant``) and within one. Tolerance (fp32 activations):
``atol 1e-5, rtol 1e-4``, the dense kernels' bound; the kernels dequantize ``fp8 * scale`` in fp32
like the reference, so only the summation order differs. On the GPU (marker ``gpu``) bf16 at the
35B-A3B shape: ``2e-2``, as the dense bf16 tests (the reference rounds the dequantized weights to
bf16, the kernels do not).
"""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize  # noqa: E402
from phloem.kernels.moe import reference, route_partial  # noqa: E402
from phloem.kernels.moe import triton_decode as fused_moe  # noqa: E402
from phloem.kernels.moe.triton_decode import MoeDecodeConfig  # noqa: E402
from phloem.kernels.moe.triton_grouped import fused_moe_grouped  # noqa: E402
from phloem.kernels.moe.triton_token import MoeTokenConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTER = 200, 136
TOL = dict(atol=1e-5, rtol=1e-4)


def _fp8(w: torch.Tensor, dtype: torch.dtype) -> Fp8Weight:
    data, scale = fp8_block_quantize(w, (1, 128))
    return Fp8Weight(data.to(DEVICE), scale.to(DEVICE), dtype)


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = _fp8(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5, dtype)
    w_down = _fp8(torch.randn(experts, hidden, inter, generator=gen) / inter**0.5, dtype)
    return w_gate_up, w_down, gen


def _routed(tokens: int, experts: int, top_k: int, seed: int = 0, hidden: int = HIDDEN, inter: int = INTER):
    w_gate_up, w_down, gen = _experts(experts, hidden, inter, torch.float32, seed)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    weights, ids = reference.moe_route(torch.randn(tokens, experts, generator=gen).to(DEVICE), top_k, True)
    return x, w_gate_up, w_down, weights, ids


def test_reference_dequantizes_only_the_selected_experts(monkeypatch: pytest.MonkeyPatch, assert_close) -> None:
    """Equal to ``fused_moe`` on the whole weights dequantized (the dequantize-on-read path), while
    dequantizing one ``[N, K]`` expert at a time, the selected ones only."""
    x, w_gate_up, w_down, weights, ids = _routed(2, 8, 2)
    dense = reference.fused_moe(x, w_gate_up.dense(), w_down.dense(), weights, ids)
    shapes: list[tuple[int, ...]] = []
    real = Fp8Weight.dense

    def counted(self: Fp8Weight) -> torch.Tensor:
        shapes.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(Fp8Weight, "dense", counted)
    got = reference.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert_close(got, dense, exact=True)
    selected = len(torch.unique(ids))
    assert selected < 8 and sorted(shapes) == sorted([(2 * INTER, HIDDEN)] * selected + [(HIDDEN, INTER)] * selected)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("down_prefetch", [True, False], ids=["down-prefetch", "down-one-tile"])
@pytest.mark.parametrize("block_k", [16, 256], ids=["tiles-in-one-block", "tiles-over-blocks"])
def test_small_batch_matches_reference(assert_close, block_k: int, down_prefetch: bool) -> None:
    """The grouped GEMV's two stages (``fused_moe_tuned``), both down walks; tiles of 256 columns
    over ``H = 300`` and ``I = 264``: two a row, the second with a partial scale block and one
    past the scales' end."""
    wide = block_k > 128
    args = _routed(3, 6, 2, hidden=300 if wide else HIDDEN, inter=264 if wide else INTER)
    block_n = 64 if wide else 16
    config = MoeDecodeConfig(block_n, block_k, 4, 1, block_n, block_k, 4, 1)
    got = fused_moe.fused_moe_tuned(*args, config, down_prefetch=down_prefetch)
    assert_close(got, reference.fused_moe(*args), **TOL)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("fp8_proj", ["gate_up", "down"])
def test_one_projection_fp8_the_other_dense(assert_close, fp8_proj: str) -> None:
    """A checkpoint may quantize one expert projection only: each stage reads its own operand."""
    x, w_gate_up, w_down, weights, ids = _routed(2, 6, 2, seed=1)
    if fp8_proj == "gate_up":
        w_down = w_down.dense()
    else:
        w_gate_up = w_gate_up.dense()
    got = fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert_close(got, reference.fused_moe(x, w_gate_up, w_down, weights, ids), **TOL)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("layout", [MoeTokenConfig(2, 4, 1), MoeTokenConfig(4, 4, 0)], ids=["walk", "tile-per-program"])
@pytest.mark.parametrize("hidden", [HIDDEN, 100], ids=["rows-over-blocks", "rows-in-one-block"])
def test_one_token_matches_reference(assert_close, layout: MoeTokenConfig, hidden: int) -> None:
    """``triton_token``'s gate/up (whole rows, ``KP = next_pow2(H)`` wide) and the prefetching down walk."""
    w_gate_up, w_down, gen = _experts(9, hidden, INTER, torch.float32, seed=hidden)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE)
    weights, ids = reference.moe_route_shared(torch.randn(1, 9, generator=gen).to(DEVICE), 3, True)
    got = fused_moe.fused_moe_token(x, w_gate_up, w_down, weights, ids, layout)
    assert_close(got, reference.fused_moe(x, w_gate_up, w_down, weights, ids), **TOL)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("tokens", [1, 3], ids=["one-token", "batch"])
def test_routed_matches_reference(assert_close, tokens: int) -> None:
    """``fused_moe_routed``: the routing in the gate/up programs (one token: ``triton_token``'s)."""
    w_gate_up, w_down, gen = _experts(9, HIDDEN, INTER, torch.float32, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    logits = torch.randn(tokens, 9, generator=gen).to(DEVICE)
    got = fused_moe.fused_moe_routed(x, logits, w_gate_up, w_down, 3, True)
    assert_close(got, reference.fused_moe_routed(x, logits, w_gate_up, w_down, 3, True), **TOL)


@pytest.mark.slow  # the Triton interpreter
def test_route_partial_matches_reference(assert_close) -> None:
    """``fused_moe_token_route_partial``: norm, logits from the router partial's accumulator, routing."""
    w_gate_up, w_down, gen = _experts(9, HIDDEN, INTER, torch.float32, seed=5)
    y, residual = (torch.randn(1, HIDDEN, generator=gen).to(DEVICE) for _ in range(2))
    router_t = (torch.randn(HIDDEN, 9, generator=gen) * HIDDEN**-0.5).to(DEVICE)
    norm_w = (torch.randn(HIDDEN, generator=gen) * 0.1).to(DEVICE)
    acc = route_partial.new_route_acc(9, DEVICE)
    s = route_partial.add_route_partial(y, residual, router_t, norm_w, acc)
    ref_acc = acc.clone()
    got = fused_moe.fused_moe_token_route_partial(s, acc, norm_w, 1e-6, w_gate_up, w_down, 3, True)
    expected = route_partial.fused_moe_route_partial(s, ref_acc, norm_w, 1e-6, w_gate_up, w_down, 3, True)
    assert_close(got, expected, **TOL)
    assert not acc.any() and not ref_acc.any()


@pytest.mark.slow  # the Triton interpreter
def test_grouped_matches_reference(assert_close) -> None:
    """The prefill grouped GEMM dequantizes each weight tile before its ``tl.dot``."""
    args = _routed(5, 6, 3, seed=2)
    got = fused_moe_grouped(*args, block_m=16, block_n=32, block_k=32)
    assert_close(got, reference.fused_moe(*args), **TOL)


def test_grouped_refuses_tiles_across_scale_blocks() -> None:
    with pytest.raises(ValueError, match="block_k"):
        fused_moe_grouped(*_routed(2, 4, 2), block_k=256)


def test_malformed_scales_are_refused() -> None:
    x, w_gate_up, w_down, weights, ids = _routed(2, 4, 2)
    bad = Fp8Weight(w_gate_up.data, w_gate_up.scale_inv[:, :, :1], w_gate_up.dtype)
    with pytest.raises(ValueError, match="scales"):
        fused_moe.fused_moe(x, bad, w_down, weights, ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_real_shape_bf16(assert_close, tokens: int) -> None:
    """bf16 activations at the 35B-A3B shape (256 experts + shared, top-8): fused_moe and routed."""
    w_gate_up, w_down, gen = _experts(257, 2048, 512, torch.bfloat16, seed=0)
    x = torch.randn(tokens, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    logits = torch.randn(tokens, 257, generator=gen).to(DEVICE, torch.bfloat16)
    w32 = [Fp8Weight(w.data, w.scale_inv, torch.float32) for w in (w_gate_up, w_down)]
    expected = reference.fused_moe_routed(x.float(), logits.float(), *w32, 8, True)
    got = fused_moe.fused_moe_routed(x, logits, w_gate_up, w_down, 8, True)
    assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    weights, ids = reference.moe_route_shared(logits, 8, True)
    expected = reference.fused_moe(x.float(), *w32, weights.float(), ids)
    assert_close(fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids).float(), expected, atol=2e-2, rtol=2e-2)
    grouped = fused_moe_grouped(x, w_gate_up, w_down, weights, ids)
    assert_close(grouped.float(), expected, atol=2e-2, rtol=2e-2)
