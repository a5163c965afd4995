from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from phloem.kernels.gdn.reference import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, recurrent_gated_delta_rule

NUM_K_HEADS, NUM_V_HEADS, K_DIM, V_DIM = 2, 4, 32, 24
NUM_SLOTS = 10
# Chunked vs recurrent in fp32 differ by reassociation only (outputs are O(0.1): q is unit-norm and scaled).
FP32_TOL = {"atol": 1e-6, "rtol": 1e-4}

# (seq_lens, has_initial_state, chunk_size): around chunk boundaries, a single token, varlen batches.
CHUNK_CASES = {
    "one_token": ([1], [True], 16),
    "chunk_minus_1": ([15], [False], 16),
    "chunk": ([16], [True], 16),
    "chunk_plus_1": ([17], [True], 16),
    "odd_multi_chunk": ([50], [False], 16),
    "varlen": ([1, 17, 33, 5], [False, True, True, False], 16),
    "default_chunk": ([130, 3], [True, False], 64),
}


def _inputs(seq_lens: list[int], dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, NUM_K_HEADS, K_DIM).to(dtype)
    k = torch.randn(num_tokens, NUM_K_HEADS, K_DIM).to(dtype)
    v = torch.randn(num_tokens, NUM_V_HEADS, V_DIM).to(dtype)
    g = F.logsigmoid(torch.randn(num_tokens, NUM_V_HEADS) + 2)  # fp32 log decay in (-inf, 0)
    beta = torch.rand(num_tokens, NUM_V_HEADS).to(dtype)
    ssm_states = torch.randn(NUM_SLOTS, NUM_V_HEADS, K_DIM, V_DIM) * 0.1
    query_start_loc = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, ssm_states, query_start_loc


def _expand(x: torch.Tensor) -> torch.Tensor:
    return x.repeat_interleave(NUM_V_HEADS // NUM_K_HEADS, dim=-2)


@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("case", list(CHUNK_CASES), ids=list(CHUNK_CASES))
def test_chunk_matches_naive_recurrent(assert_close, case, same_slot) -> None:
    seq_lens, has_init, chunk_size = CHUNK_CASES[case]
    q, k, v, g, beta, ssm_states, query_start_loc = _inputs(seq_lens)
    num_seqs = len(seq_lens)
    read_slots = torch.arange(num_seqs, dtype=torch.int64) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    before = ssm_states.clone()

    out = chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_states, query_start_loc, read_slots, write_slots, torch.tensor(has_init), chunk_size
    )
    for i in range(num_seqs):
        s = slice(query_start_loc[i], query_start_loc[i + 1])
        initial = before[read_slots[i]].double() if has_init[i] else None
        ref_args = (x[s].double() for x in (q, k, v, g, beta))
        expected, expected_state = naive_recurrent_gated_delta_rule(*ref_args, initial_state=initial)
        assert_close(out[s], expected.float(), **FP32_TOL, msg=f"output of sequence {i}")
        assert_close(ssm_states[write_slots[i]], expected_state.float(), **FP32_TOL, msg=f"state of sequence {i}")
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[write_slots] = False
    assert_close(ssm_states[untouched], before[untouched], exact=True, msg="read / unused slots")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seq_lens", [[1], [64], [65, 7]], ids=["T1", "T64", "varlen_65_7"])
def test_chunk_matches_hf(hf_qwen3_next: ModuleType, assert_close, seq_lens, dtype) -> None:
    q, k, v, g, beta, ssm_states, query_start_loc = _inputs(seq_lens, dtype, seed=1)
    slots = torch.arange(len(seq_lens), dtype=torch.int64)
    before = ssm_states.clone()
    has_initial_state = torch.ones(len(seq_lens), dtype=torch.bool)
    out = chunk_gated_delta_rule(q, k, v, g, beta, ssm_states, query_start_loc, slots, slots, has_initial_state)
    for i in range(len(seq_lens)):
        s = slice(query_start_loc[i], query_start_loc[i + 1])
        expected, expected_state = hf_qwen3_next.torch_chunk_gated_delta_rule(
            _expand(q[s])[None], _expand(k[s])[None], v[s][None], g[s][None], beta[s][None],
            initial_state=before[i][None], output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert_close(out[s], expected[0], msg=f"output of sequence {i}")
        assert_close(ssm_states[i], expected_state[0], msg=f"state of sequence {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3"])
def test_recurrent_matches_hf(hf_qwen3_next: ModuleType, assert_close, batch, same_slot, dtype) -> None:
    q, k, v, g, beta, ssm_states, _ = _inputs([1] * batch, dtype, seed=2)
    read_slots = torch.arange(batch, dtype=torch.int64).flip(0) + 1
    write_slots = read_slots if same_slot else read_slots + batch
    before = ssm_states.clone()
    expected, expected_state = hf_qwen3_next.torch_recurrent_gated_delta_rule(
        _expand(q)[:, None], _expand(k)[:, None], v[:, None], g[:, None], beta[:, None],
        initial_state=before[read_slots], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    out = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, read_slots, write_slots)
    assert_close(out, expected[:, 0], exact=True)
    assert_close(ssm_states[write_slots], expected_state, exact=True)
    if not same_slot:
        assert_close(ssm_states[read_slots], before[read_slots], exact=True, msg="read slots")


@pytest.mark.parametrize("split", [1, 16, 23], ids=lambda s: f"split_at_{s}")
def test_split_prefill_equals_one_call(assert_close, split) -> None:
    q, k, v, g, beta, ssm_states, _ = _inputs([40], seed=3)
    states_two = ssm_states.clone()
    fresh, cached = torch.tensor([False]), torch.tensor([True])
    slot_a, slot_b = torch.tensor([0]), torch.tensor([1])

    def call(s: slice, states: torch.Tensor, read: torch.Tensor, has_init: torch.Tensor) -> torch.Tensor:
        loc = torch.tensor([0, s.stop - s.start], dtype=torch.int32)
        args = (x[s] for x in (q, k, v, g, beta))
        return chunk_gated_delta_rule(*args, states, loc, read, slot_b, has_init, chunk_size=16)

    whole = call(slice(0, 40), ssm_states, slot_a, fresh)
    first = call(slice(0, split), states_two, slot_a, fresh)
    second = call(slice(split, 40), states_two, slot_b, cached)
    assert_close(torch.cat([first, second]), whole, **FP32_TOL)
    assert_close(states_two[1], ssm_states[1], **FP32_TOL)


def test_prefill_then_decode_matches_naive(assert_close) -> None:
    q, k, v, g, beta, ssm_states, _ = _inputs([21], seed=4)
    slot = torch.tensor([3])
    prefill = chunk_gated_delta_rule(
        q[:20], k[:20], v[:20], g[:20], beta[:20], ssm_states,
        torch.tensor([0, 20], dtype=torch.int32), slot, slot, torch.tensor([False]), chunk_size=8,
    )
    decode = recurrent_gated_delta_rule(q[20:], k[20:], v[20:], g[20:], beta[20:], ssm_states, slot, slot)
    expected, expected_state = naive_recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)))
    assert_close(torch.cat([prefill, decode]), expected.float(), **FP32_TOL)
    assert_close(ssm_states[3], expected_state.float(), **FP32_TOL)
