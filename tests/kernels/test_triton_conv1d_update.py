from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.gdn.conv1d import causal_conv1d_update as reference  # noqa: E402
from phloem.kernels.gdn.triton_conv1d import causal_conv1d_update  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_SLOTS = 8

# (num_seqs, channels, kernel): size 1, odd channels, two channel blocks (256 + 44), short kernels.
SHAPES = {
    "B1_D1_K4": (1, 1, 4),
    "B3_D37_K4": (3, 37, 4),
    "B2_D300_K4": (2, 300, 4),
    "B2_D33_K2": (2, 33, 2),
    "B2_D16_K3": (2, 16, 3),
}


def _inputs(num_seqs, dim, kernel_size, with_bias, dtype=torch.float32, num_slots=NUM_SLOTS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_seqs, dim, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(dim, kernel_size, generator=gen) * 0.5).to(DEVICE, dtype)
    bias = torch.randn(dim, generator=gen).to(DEVICE, dtype) if with_bias else None
    conv_states = torch.randn(num_slots, dim, kernel_size - 1, generator=gen).to(DEVICE, dtype)
    return x, weight, bias, conv_states


def _check(assert_close, args, read_slots, write_slots) -> None:
    """Output within the dtype's tolerance; the shifted state is a copy, so it must match exactly."""
    x, weight, bias, conv_states = args
    before = conv_states.clone()
    expected_states = conv_states.clone()
    expected = reference(x, weight, bias, expected_states, read_slots, write_slots)

    out = causal_conv1d_update(x, weight, bias, conv_states, read_slots, write_slots)
    assert_close(out, expected, msg="out")
    assert_close(conv_states, expected_states, exact=True, msg="states")
    untouched = torch.ones(conv_states.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[write_slots] = False
    assert_close(conv_states[untouched], before[untouched], exact=True, msg="read / unused slots")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference(assert_close, shape, same_slot, with_bias) -> None:
    args = _inputs(*shape, with_bias)
    read_slots = torch.arange(shape[0], dtype=torch.int64, device=DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    _check(assert_close, args, read_slots, write_slots)


def test_shared_read_slot_and_scattered_writes(assert_close) -> None:
    args = _inputs(3, 20, 4, with_bias=True, seed=1)
    _check(assert_close, args, torch.tensor([6, 6, 2], device=DEVICE), torch.tensor([1, 7, 2], device=DEVICE))


def test_strided_input_row(assert_close) -> None:
    """``x`` as a column slice of a wider projection (row stride != D)."""
    x, weight, bias, conv_states = _inputs(2, 24, 4, with_bias=False, seed=2)
    wide = torch.cat((x, torch.randn(2, 5, device=DEVICE)), dim=-1)[:, :24]
    slots = torch.tensor([0, 3], device=DEVICE)
    _check(assert_close, (wide, weight, bias, conv_states), slots, slots)


def test_bfloat16_runs_and_keeps_dtypes(assert_close) -> None:
    """Dtype plumbing only on CPU: the interpreter truncates fp32 -> bf16 instead of rounding to nearest."""
    x, weight, bias, conv_states = _inputs(2, 40, 4, with_bias=True, dtype=torch.bfloat16, seed=3)
    slots = torch.tensor([1, 4], device=DEVICE)
    expected_states = conv_states.clone()
    expected = reference(x, weight, bias, expected_states, slots, slots)
    out = causal_conv1d_update(x, weight, bias, conv_states, slots, slots)
    assert_close(out, expected, atol=3e-2, rtol=3e-2)
    assert_close(conv_states, expected_states, exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("num_seqs", [1, 8, 61])
def test_qwen35_35b_a3b_shape_on_cuda(assert_close, num_seqs, same_slot, dtype) -> None:
    # conv_dim = 2 * 16 * 128 + 32 * 128 channels, kernel 4, no bias (as the model).
    args = _inputs(num_seqs, 8192, 4, with_bias=False, dtype=dtype, num_slots=2 * num_seqs + 1, seed=4)
    read_slots = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    _check(assert_close, args, read_slots, write_slots)
