from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.sampling.reference import argmax as reference  # noqa: E402
from phloem.kernels.sampling.triton_argmax import argmax  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check(logits: torch.Tensor) -> None:
    got = argmax(logits)
    assert got.dtype == torch.int64 and got.shape == logits.shape[:1]
    assert got.tolist() == reference(logits).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5000), (3, 2049), (2, 7), (1, 1)])
def test_random_rows(rows: int, vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    _check((torch.randn(rows, vocab, generator=gen) * 4).to(DEVICE, dtype))


def test_ties_take_the_first_index_across_chunks() -> None:
    """The maximum in several chunks and several times within one: the first occurrence wins."""
    logits = torch.zeros(4, 6000, device=DEVICE)
    logits[0, [4100, 17, 5999]] = 3.0
    logits[1] = 1.0  # every entry ties
    logits[2, [2048, 2049, 4095]] = 2.5
    logits[3, [5000, 3000]] = torch.finfo(torch.float32).max
    _check(logits)


def test_nan_inf_and_signed_zero_follow_torch() -> None:
    logits = torch.full((5, 3000), float("-inf"), device=DEVICE)  # row 0: all -inf -> index 0
    logits[1, 2500] = float("nan")  # a NaN beats +inf ...
    logits[1, 10] = float("inf")
    logits[2, [2999, 1500]] = float("nan")  # ... and the first NaN wins
    logits[3, 2100] = 0.0  # -0.0 equals +0.0: the first of them wins
    logits[3, 700] = -0.0
    logits[4, 40] = float("inf")
    _check(logits)


def test_strided_rows() -> None:
    wide = torch.randn(3, 9000, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _check(wide[:, 1000:6000])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_qwen35_vocabulary_on_cuda(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    _check(torch.randn(rows, 248320, device="cuda", generator=gen).to(torch.bfloat16))


@pytest.mark.parametrize("impl", [argmax, reference], ids=["triton", "reference"])
def test_copy_to_gets_the_same_ids(impl) -> None:
    """``copy_to`` (the CUDA-graph step's input-id row) is written with the returned ids."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    copy_to = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    ids = impl(logits, copy_to)
    assert torch.equal(ids, torch.argmax(logits, dim=-1)) and torch.equal(copy_to, ids)


def test_copy_to_of_another_shape_is_refused() -> None:
    logits = torch.randn(2, 100).to(DEVICE)
    for bad in (torch.empty(3, dtype=torch.int64), torch.empty(2, dtype=torch.int32), torch.empty(4, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="copy_to"):
            argmax(logits, bad.to(DEVICE))


@pytest.mark.parametrize("impl", [argmax, reference], ids=["triton", "reference"])
def test_out_receives_the_ids_and_is_returned(impl) -> None:
    """``out`` (a CUDA graph's ids buffer outside its memory pool) is written and returned."""
    logits = torch.randn(4, 3000, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    copy_to = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
    ids = impl(logits, copy_to, out)
    assert ids is out and torch.equal(out, torch.argmax(logits, dim=-1)) and torch.equal(copy_to, out)


def test_out_of_another_shape_is_refused() -> None:
    logits = torch.randn(2, 100).to(DEVICE)
    with pytest.raises(ValueError, match="out"):
        argmax(logits, None, torch.empty(3, dtype=torch.int64).to(DEVICE))
