from __future__ import annotations

from types import ModuleType

import pytest
import torch

from phloem.kernels.gdn.conv1d import causal_conv1d_update, causal_conv1d_varlen

KERNEL = 4
NUM_SLOTS = 8
DTYPES = [torch.float32, torch.bfloat16]

# (seq_lens, has_initial_state): single token, shorter than K-1, exactly K-1, long and mixed batches.
VARLEN_CASES = {
    "one_token_fresh": ([1], [False]),
    "one_token_cached": ([1], [True]),
    "shorter_than_state": ([2, 1], [True, True]),
    "state_len": ([3], [True]),
    "odd_mixed": ([5, 1, 17, 2], [False, True, True, False]),
    "long": ([64, 33], [True, False]),
}


def _inputs(seq_lens: list[int], dim: int, dtype: torch.dtype, with_bias: bool):
    torch.manual_seed(sum(seq_lens) + dim)
    x = torch.randn(sum(seq_lens), dim).to(dtype)
    weight = (torch.randn(dim, KERNEL) * 0.5).to(dtype)
    bias = torch.randn(dim).to(dtype) if with_bias else None
    conv_states = torch.randn(NUM_SLOTS, dim, KERNEL - 1).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, bias, conv_states, query_start_loc


def _hf_per_sequence(hf, x, weight, bias, conv_states, query_start_loc, read_slots, has_initial_state):
    """HF ``causal_conv1d_update`` on each sequence alone, with a K-1 state; returns (out, final states)."""
    outs, finals = [], []
    for i in range(len(read_slots)):
        xs = x[query_start_loc[i] : query_start_loc[i + 1]]
        state = conv_states[read_slots[i]].clone()[None]
        if not has_initial_state[i]:
            state.zero_()
        outs.append(hf.causal_conv1d_update(xs.T[None], state, weight, bias, "silu")[0].T)
        finals.append(state[0])
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("case", list(VARLEN_CASES), ids=list(VARLEN_CASES))
def test_varlen_matches_hf_per_sequence(
    hf_qwen3_next: ModuleType, assert_close, case, same_slot, with_bias, dtype
) -> None:
    seq_lens, has_init = VARLEN_CASES[case]
    x, weight, bias, conv_states, query_start_loc = _inputs(seq_lens, 37, dtype, with_bias)
    num_seqs = len(seq_lens)
    read_slots = torch.arange(num_seqs, dtype=torch.int64)
    write_slots = read_slots if same_slot else read_slots + num_seqs
    has_initial_state = torch.tensor(has_init)
    before = conv_states.clone()
    expected_out, expected_states = _hf_per_sequence(
        hf_qwen3_next, x, weight, bias, before, query_start_loc, read_slots, has_initial_state
    )

    out = causal_conv1d_varlen(
        x, weight, bias, conv_states, query_start_loc, read_slots, write_slots, has_initial_state
    )
    assert_close(out, expected_out, exact=True)
    assert_close(conv_states[write_slots], expected_states, exact=True)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[write_slots] = False
    assert_close(conv_states[untouched], before[untouched], exact=True, msg="read / unused slots")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fresh_sequence_matches_hf_causal_conv1d_fn(hf_qwen3_next: ModuleType, assert_close, dtype) -> None:
    x, weight, bias, conv_states, query_start_loc = _inputs([19], 16, dtype, with_bias=True)
    slots = torch.tensor([2])
    out = causal_conv1d_varlen(x, weight, bias, conv_states, query_start_loc, slots, slots, torch.tensor([False]))
    expected = hf_qwen3_next.causal_conv1d_fn(x.T[None], weight, bias, activation="silu")[0].T
    # HF pads instead of concatenating a zero state, so the conv may sum in another order.
    assert_close(out, expected)
    assert_close(conv_states[2], x[-(KERNEL - 1) :].T, exact=True)


@pytest.mark.parametrize("split", [1, 2, 6, 10], ids=lambda s: f"split_at_{s}")
def test_split_prefill_equals_one_call(assert_close, split) -> None:
    x, weight, bias, conv_states, _ = _inputs([11], 9, torch.float32, with_bias=True)
    states_one, states_two = conv_states.clone(), conv_states.clone()
    fresh = torch.tensor([False])
    whole = causal_conv1d_varlen(
        x, weight, bias, states_one, torch.tensor([0, 11], dtype=torch.int32),
        torch.tensor([0]), torch.tensor([1]), fresh,
    )
    first = causal_conv1d_varlen(
        x[:split], weight, bias, states_two, torch.tensor([0, split], dtype=torch.int32),
        torch.tensor([0]), torch.tensor([1]), fresh,
    )
    second = causal_conv1d_varlen(
        x[split:], weight, bias, states_two, torch.tensor([0, 11 - split], dtype=torch.int32),
        torch.tensor([1]), torch.tensor([1]), torch.tensor([True]),
    )
    assert_close(torch.cat([first, second]), whole)
    assert_close(states_two, states_one, exact=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_update_matches_hf(hf_qwen3_next: ModuleType, assert_close, batch, same_slot, dtype) -> None:
    x, weight, bias, conv_states, _ = _inputs([1] * batch, 37, dtype, with_bias=True)
    read_slots = torch.arange(batch, dtype=torch.int64).flip(0)
    write_slots = read_slots if same_slot else read_slots + batch
    before = conv_states.clone()
    expected_state = before[read_slots].clone()
    expected = hf_qwen3_next.causal_conv1d_update(x[:, :, None], expected_state, weight, bias, "silu")[:, :, 0]

    out = causal_conv1d_update(x, weight, bias, conv_states, read_slots, write_slots)
    assert_close(out, expected, exact=True)
    assert_close(conv_states[write_slots], expected_state, exact=True)
    if not same_slot:
        assert_close(conv_states[read_slots], before[read_slots], exact=True, msg="read slots")


def test_update_equals_varlen_of_single_tokens(assert_close) -> None:
    x, weight, bias, conv_states, query_start_loc = _inputs([1, 1, 1], 12, torch.float32, with_bias=False)
    slots = torch.tensor([4, 0, 2])
    states_varlen = conv_states.clone()
    out_update = causal_conv1d_update(x, weight, bias, conv_states, slots, slots)
    out_varlen = causal_conv1d_varlen(
        x, weight, bias, states_varlen, query_start_loc, slots, slots, torch.ones(3, dtype=torch.bool)
    )
    assert_close(out_update, out_varlen)
    assert_close(conv_states, states_varlen, exact=True)
