from __future__ import annotations

import os

import pytest
import torch

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.gdn.conv1d import causal_conv1d_varlen as reference  # noqa: E402
from phloem.kernels.gdn.triton_conv1d_varlen import causal_conv1d_varlen  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(lens, dim, kernel_size, with_bias, num_slots, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), dim, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(dim, kernel_size, generator=gen) * 0.5).to(DEVICE, dtype)
    bias = torch.randn(dim, generator=gen).to(DEVICE, dtype) if with_bias else None
    conv_states = torch.randn(num_slots, dim, kernel_size - 1, generator=gen).to(DEVICE, dtype)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return x, weight, bias, conv_states, starts


def _check(assert_close, args, read_slots, write_slots, has_initial, exact_out=False, **tol) -> None:
    """Outputs within the dtype's tolerance; new states are copies, so they must match exactly,
    and no slot outside ``write_slots`` changes."""
    x, weight, bias, conv_states, starts = args
    before = conv_states.clone()
    expected_states = conv_states.clone()
    expected = reference(x, weight, bias, expected_states, starts, read_slots, write_slots, has_initial)
    out = causal_conv1d_varlen(x, weight, bias, conv_states, starts, read_slots, write_slots, has_initial)
    assert_close(out, expected, exact=exact_out, msg="out", **tol)
    assert_close(conv_states, expected_states, exact=True, msg="states")
    untouched = torch.ones(conv_states.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[write_slots] = False
    assert_close(conv_states[untouched], before[untouched], exact=True, msg="unwritten slots")


# (sequence lengths, channels, kernel): a prefill chunk beside decode rows (a mixed step), sequences
# shorter than the state, token blocks that straddle sequences, two channel blocks (128 + 44).
CASES = {
    "mixed_step": ([40, 1, 1, 1], 24, 4),
    "short_seqs": ([1, 2, 3, 4, 5], 16, 4),
    "one_long": ([70], 37, 4),
    "channel_blocks": ([3, 33], 172, 4),
    "K2": ([1, 9, 2], 20, 2),
    "K3": ([5, 1], 12, 3),
    "many_seqs": ([1] * 20 + [7, 3] + [1] * 15, 8, 4),
    # The prefill graphs' static layout: empty sequences pass their state through.
    "empty_seqs": ([0, 5, 0, 0, 1, 3, 0], 16, 4),
}


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_reference(assert_close, case, same_slot, with_bias) -> None:
    lens, dim, kernel_size = case
    num = len(lens)
    args = _inputs(lens, dim, kernel_size, with_bias, num_slots=2 * num + 1)
    read_slots = torch.arange(num, dtype=torch.int64, device=DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    has_initial = torch.tensor([i % 3 != 1 for i in range(num)], device=DEVICE)  # some start from zeros
    _check(assert_close, args, read_slots, write_slots, has_initial)


def test_reads_happen_before_writes_across_sequences(assert_close) -> None:
    """One sequence writes the slot another reads (the reference gathers every state first), and two
    share a read slot (a fork from one checkpoint)."""
    args = _inputs([2, 5, 1], 10, 4, with_bias=True, num_slots=6, seed=1)
    read_slots = torch.tensor([3, 3, 1], device=DEVICE)
    write_slots = torch.tensor([1, 4, 5], device=DEVICE)
    _check(assert_close, args, read_slots, write_slots, torch.tensor([True, True, True], device=DEVICE))


def test_strided_input_rows(assert_close) -> None:
    """``x`` as a column slice of a wider projection (row stride != D)."""
    x, weight, bias, conv_states, starts = _inputs([4, 1], 24, 4, with_bias=False, num_slots=4, seed=2)
    wide = torch.cat((x, torch.randn(x.shape[0], 5, device=DEVICE)), dim=-1)[:, :24]
    slots = torch.tensor([0, 3], device=DEVICE)
    _check(assert_close, (wide, weight, bias, conv_states, starts), slots, slots, torch.tensor([True, False], device=DEVICE))


def test_bfloat16_runs_and_keeps_dtypes(assert_close) -> None:
    """Dtype plumbing only on CPU: the interpreter truncates fp32 -> bf16 instead of rounding to nearest."""
    args = _inputs([6, 1], 40, 4, with_bias=True, num_slots=4, dtype=torch.bfloat16, seed=3)
    slots = torch.tensor([1, 2], device=DEVICE)
    _check(assert_close, args, slots, slots, torch.tensor([True, True], device=DEVICE), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("lens", [[800] + [1] * 15, [8192], [1000, 17, 3]], ids=["mixed", "chunk", "three"])
def test_qwen35_35b_a3b_shape_on_cuda(assert_close, lens, dtype) -> None:
    # conv_dim = 2 * 16 * 128 + 32 * 128 channels, kernel 4, no bias (as the model).
    num = len(lens)
    args = _inputs(lens, 8192, 4, with_bias=False, num_slots=2 * num + 1, dtype=dtype, seed=4)
    read_slots = torch.randperm(num, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 2
    has_initial = torch.tensor([i != 1 for i in range(num)], device=DEVICE)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    _check(assert_close, args, read_slots, read_slots + 1, has_initial, **tol)
