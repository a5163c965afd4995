"""The experts of one token (``kernels.moe.triton_token``'s gate/up, then ``fused_moe``'s down) against
the torch references ``kernels.moe.reference.fused_moe`` / ``fused_moe_routed``.

On CPU under the interpreter at small shapes, in several launch layouts (programs walking several
tiles; one program per tile); the ids in the model's layout (the shared expert, stored last, in the
last slot: the tile the kernels load before their inputs are ready) and in others (the last slot
another expert, repeated experts), where that early tile must be replaced. On the GPU at the
35B-A3B shape (marker ``gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.moe import triton_decode as fused_moe  # noqa: E402
from phloem.kernels.moe import triton_token as moe_token  # noqa: E402
from phloem.kernels.moe.reference import fused_moe as reference  # noqa: E402
from phloem.kernels.moe.reference import fused_moe_routed as reference_routed  # noqa: E402
from phloem.kernels.moe.reference import moe_route_shared  # noqa: E402
from phloem.kernels.moe.triton_token import MoeTokenConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUTS = {
    "default": moe_token.DEFAULT_CONFIG,
    "walk": MoeTokenConfig(2, 4, 1),
    "tile_per_program": MoeTokenConfig(4, 4, 0),
    "one_row": MoeTokenConfig(1, 2, 2),
}


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    return x, w_gate_up, w_down, gen


def _shared_layout(experts: int, top_k: int, gen: torch.Generator, dtype: torch.dtype):
    """Routed top-k of ``experts - 1`` + the shared expert (``experts - 1``) last."""
    return moe_route_shared(torch.randn(1, experts, generator=gen).to(DEVICE, dtype), top_k, True)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("experts", "top_k", "hidden", "inter"), [(9, 3, 40, 24), (17, 4, 64, 32)], ids=["odd-dims", "pow2"])
def test_shared_layout_matches_reference(assert_close, layout: str, experts: int, top_k: int, hidden: int, inter: int) -> None:
    x, w_gate_up, w_down, gen = _experts(experts, hidden, inter, torch.float32, seed=experts)
    weights, ids = _shared_layout(experts, top_k, gen, torch.float32)
    got = fused_moe.fused_moe_token(x, w_gate_up, w_down, weights, ids, LAYOUTS[layout])
    assert_close(got, reference(x, w_gate_up, w_down, weights, ids), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "ids",
    [pytest.param([[3, 1, 3, 5]], marks=pytest.mark.slow), [[0]], pytest.param([[8, 2, 0, 7, 1]], marks=pytest.mark.slow)],
    ids=["repeated-and-last-not-shared", "one-slot", "last-expert-not-last"],
)
def test_any_ids_match_reference(assert_close, layout: str, ids: list[list[int]]) -> None:
    """Where the last slot is not the last expert, the tile loaded early for it is replaced."""
    x, w_gate_up, w_down, gen = _experts(9, 40, 24, torch.float32, seed=3)
    topk_ids = torch.tensor(ids, device=DEVICE)
    weights = torch.rand(topk_ids.shape, generator=gen).to(DEVICE)
    got = fused_moe.fused_moe_token(x, w_gate_up, w_down, weights, topk_ids, LAYOUTS[layout])
    assert_close(got, reference(x, w_gate_up, w_down, weights, topk_ids), atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(8, 2, True), (12, 4, False), (5, 5, True)],
                         ids=["renorm", "no-renorm", "every-expert"])  # fmt: skip
def test_routed_matches_route_then_experts(assert_close, layout: str, experts: int, top_k: int, renormalize: bool) -> None:
    """Each gate/up program routes its own slot; one writes the weights and ids down reads."""
    x, w_gate_up, w_down, gen = _experts(experts + 1, 40, 24, torch.float32, seed=experts)
    logits = torch.randn(1, experts + 1, generator=gen).to(DEVICE)
    got = fused_moe.fused_moe_token_routed(x, logits, w_gate_up, w_down, top_k, renormalize, LAYOUTS[layout])
    assert_close(got, reference_routed(x, logits, w_gate_up, w_down, top_k, renormalize), atol=1e-5, rtol=1e-4)


def test_routed_rejects_bad_logits() -> None:
    x, w_gate_up, w_down, gen = _experts(5, 16, 8, torch.float32, seed=6)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe.fused_moe_token_routed(x, torch.randn(1, 5, device=DEVICE), w_gate_up, w_down, 5, True)
    with pytest.raises(ValueError, match="logits"):
        fused_moe.fused_moe_token_routed(x, torch.randn(1, 7, device=DEVICE), w_gate_up, w_down, 2, True)


@pytest.mark.slow  # the Triton interpreter: the batched kernels
def test_one_token_goes_to_the_token_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fused_moe`` with one token takes ``moe_token``; with two, the batched kernels."""
    x, w_gate_up, w_down, gen = _experts(9, 32, 16, torch.float32, seed=4)
    weights, ids = _shared_layout(9, 2, gen, torch.float32)
    calls = []
    monkeypatch.setattr(fused_moe, "fused_moe_token", lambda *a, **launch: calls.append(a) or torch.zeros_like(x))
    monkeypatch.setattr(fused_moe, "fused_moe_token_routed", lambda *a, **launch: calls.append(a) or torch.zeros_like(x))
    fused_moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    fused_moe.fused_moe(x.repeat(2, 1), w_gate_up, w_down, weights.repeat(2, 1), ids.repeat(2, 1))
    logits = torch.randn(2, 9, generator=gen).to(DEVICE)
    fused_moe.fused_moe_routed(x, logits[:1], w_gate_up, w_down, 2, True)
    fused_moe.fused_moe_routed(x.repeat(2, 1), logits, w_gate_up, w_down, 2, True)
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_real_shape_bf16(assert_close, layout: str) -> None:
    x, w_gate_up, w_down, gen = _experts(257, 2048, 512, torch.bfloat16, seed=5)
    weights, ids = _shared_layout(257, 8, gen, torch.bfloat16)
    expected = reference(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    got = fused_moe.fused_moe_token(x, w_gate_up, w_down, weights, ids, LAYOUTS[layout])
    assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    # Distinct logits (k / 64 is exact in bf16): no tie for torch.topk to break its own way.
    logits = (torch.randperm(257, generator=gen) / 64).view(1, -1).to(DEVICE, torch.bfloat16)
    expected = reference_routed(x.float(), logits.float(), w_gate_up.float(), w_down.float(), 8, True)
    got = fused_moe.fused_moe_token_routed(x, logits, w_gate_up, w_down, 8, True, LAYOUTS[layout])
    assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_default_grids_fit_the_sm_as_loaded() -> None:
    """The H200 configurations' programs an SM all resident at the 35B-A3B shape, routed and with the
    router partial: a grid sized for more leaves a second wave (the sixteenth session's gate/up went
    to 136 registers and its step from 2.03 to 2.19 ms with the grid still sized for 4)."""
    from phloem.kernels.common.device import resident_programs
    from phloem.kernels.moe.route_partial import new_route_acc

    x, w_gate_up, w_down, gen = _experts(257, 2048, 512, torch.bfloat16, seed=7)
    logits = torch.randn(1, 257, generator=gen).to(DEVICE, torch.bfloat16)
    kernel = moe_token._gate_up_token_kernel
    cases = {
        "routed": (moe_token.DEFAULT_CONFIG, lambda: fused_moe.fused_moe_token_routed(x, logits, w_gate_up, w_down, 8, True)),
        "route partial": (moe_token.PARTIAL_CONFIG, lambda: fused_moe.fused_moe_token_route_partial(
            x, new_route_acc(257, DEVICE), torch.zeros(2048, device=DEVICE, dtype=torch.bfloat16), 1e-6, w_gate_up, w_down, 8, True)),
    }  # fmt: skip
    props = torch.cuda.get_device_properties(0)
    for name, (config, run) in cases.items():
        cache = kernel.device_caches[0][0]
        cache.clear()  # compile this mode's variant afresh
        run()
        torch.cuda.synchronize()
        fits = [resident_programs(k, props) for k in cache.values()]
        assert fits and min(fits) >= config.programs_per_sm, f"{name}: {fits} programs an SM fit, the grid is sized for {config.programs_per_sm}"
