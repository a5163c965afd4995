"""The grouped W8A8 expert projection (``kernels.moe.triton_grouped_w8a8``) against its torch
reference (``kernels.moe.w8a8``), under the interpreter on CPU.

The activations are e4m3 values times a power of two per 128-column group, each group holding a
+-448: their quantization is exact, so the interpreter's fp32 -> e4m3 cast (not round-to-nearest-even,
``test_triton_w8a8``'s NOTE) has nothing to round and both sides multiply the same operands.
"""

from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_dequant, fp8_block_quantize  # noqa: E402
from phloem.kernels.moe.triton_grouped_w8a8 import fp8_w8a8_grouped_linear  # noqa: E402
from phloem.kernels.moe.w8a8 import fp8_w8a8_grouped_linear_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _exact_activations(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0x08, 0x7F, (rows, k), generator=gen, dtype=torch.uint8)
    q |= torch.randint(0, 2, (rows, k), generator=gen, dtype=torch.uint8) << 7
    q[:, ::128] = 0x7E  # 448
    power = torch.exp2(torch.randint(-10, 2, (rows, -(-k // 128)), generator=gen).float())
    return q.view(torch.float8_e4m3fn).float() * power.repeat_interleave(128, dim=1)[:, :k]


def _experts(e: int, n: int, k: int, seed: int) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=gen) / k**0.5
    data, scale = fp8_block_quantize(w, (1, 128))
    return Fp8Weight(data, scale, torch.float32)


# (tokens, top_k, experts, N, K): gate/up reads a row per token, down a row per pair; N and K off
# the tiles; more pairs than one 64-row block; experts left unused.
CASES = [(1, 2, 4, 40, 100), (9, 2, 6, 72, 300), (40, 3, 5, 130, 129)]


@pytest.mark.parametrize("per_pair", [False, True], ids=["row_per_token", "row_per_pair"])
@pytest.mark.parametrize(("t", "top_k", "e", "n", "k"), CASES, ids=str)
def test_grouped_matches_the_reference(t: int, top_k: int, e: int, n: int, k: int, per_pair: bool) -> None:
    """fp32 out: the same exact e4m3 products summed in fp32 in another order, scales per K block:
    ``|got - want| <= 1e-5 * (|x̂| @ |ŵ_e|^T)`` per pair."""
    weight = _experts(e, n, k, seed=n + k)
    gen = torch.Generator().manual_seed(t)
    topk_ids = torch.stack([torch.randperm(e - 1, generator=gen)[:top_k] for _ in range(t)])  # expert e-1 unused
    x = _exact_activations(t * top_k if per_pair else t, k, seed=t + k)
    got = fp8_w8a8_grouped_linear(x.to(DEVICE), Fp8Weight(weight.data.to(DEVICE), weight.scale_inv.to(DEVICE), torch.float32),
                                  topk_ids.to(DEVICE)).cpu()  # fmt: skip
    want = fp8_w8a8_grouped_linear_reference(x, weight, topk_ids)
    assert got.shape == want.shape == (t * top_k, n)
    src = torch.arange(t * top_k) // (1 if per_pair else top_k)
    w_hat = fp8_block_dequant(weight.data, weight.scale_inv, (1, 128))[topk_ids.flatten()]  # [P, N, K]
    bound = 1e-5 * torch.einsum("pk,pnk->pn", x[src].abs(), w_hat.abs())
    err = (got - want).abs()
    assert (err <= bound).all(), f"max err {err.max():.3e}"
    # Each pair used its own expert: the pairs routed one expert further give other products.
    assert want.abs().max() > 0 and not torch.allclose(got, fp8_w8a8_grouped_linear_reference(x, weight, (topk_ids + 1) % e))


def test_bad_row_count_raises() -> None:
    weight = _experts(3, 8, 128, seed=0)
    with pytest.raises(ValueError, match="activation rows"):
        fp8_w8a8_grouped_linear_reference(torch.ones(5, 128), weight, torch.zeros(4, 2, dtype=torch.int64))
