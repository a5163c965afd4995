from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.gdn.reference import recurrent_gated_delta_rule as reference  # noqa: E402
from phloem.kernels.gdn.reference import recurrent_gated_delta_rule_with_gates as reference_with_gates  # noqa: E402
from phloem.kernels.gdn.triton_decode import (  # noqa: E402
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_with_gates,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_SLOTS = 8
# Same fp32 math as the reference; sums over Dk may associate differently.
FP32_TOL = {"atol": 1e-5, "rtol": 1e-4}

# (num_seqs, Hk, Hv, Dk, Dv): one sequence, GQA and MHA heads, odd dims, two value blocks.
SHAPES = {
    "B1_gqa": (1, 1, 2, 16, 16),
    "B3_odd_dims": (3, 2, 4, 24, 40),
    "B2_mha": (2, 3, 3, 8, 5),
}


def _inputs(num_seqs, num_k_heads, num_v_heads, k_dim, v_dim, dtype=torch.float32, num_slots=NUM_SLOTS, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = randn(num_seqs, num_k_heads, k_dim).to(DEVICE, dtype)
    k = randn(num_seqs, num_k_heads, k_dim).to(DEVICE, dtype)
    v = randn(num_seqs, num_v_heads, v_dim).to(DEVICE, dtype)
    g = F.logsigmoid(randn(num_seqs, num_v_heads) + 2).to(DEVICE)  # fp32 log decay in (-inf, 0)
    beta = torch.rand(num_seqs, num_v_heads, generator=gen).to(DEVICE, dtype)
    ssm_states = (randn(num_slots, num_v_heads, k_dim, v_dim) * 0.1).to(DEVICE)
    return q, k, v, g, beta, ssm_states


def _check(assert_close, args, read_slots, write_slots, out_tol, state_tol) -> None:
    """Runs both versions on copies of the state; checks output, written slots and every other slot."""
    q, k, v, g, beta, ssm_states = args
    before = ssm_states.clone()
    expected_states = ssm_states.clone()
    expected = reference(q, k, v, g, beta, expected_states, read_slots, write_slots)

    out = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, read_slots, write_slots)
    assert_close(out, expected, **out_tol, msg="out")
    assert_close(ssm_states[write_slots], expected_states[write_slots], **state_tol, msg="written state")
    untouched = torch.ones(ssm_states.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[write_slots] = False
    assert_close(ssm_states[untouched], before[untouched], exact=True, msg="read / unused slots")


@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_matches_reference(assert_close, shape, same_slot) -> None:
    args = _inputs(*shape)
    num_seqs = shape[0]
    read_slots = torch.arange(num_seqs, dtype=torch.int64, device=DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    _check(assert_close, args, read_slots, write_slots, FP32_TOL, FP32_TOL)


def test_shared_read_slot_and_scattered_writes(assert_close) -> None:
    """Two sequences forked from one checkpoint: both read slot 5, writes land in unordered slots."""
    args = _inputs(3, 2, 4, 16, 16, seed=1)
    read_slots = torch.tensor([5, 5, 0], device=DEVICE)
    write_slots = torch.tensor([7, 1, 0], device=DEVICE)
    _check(assert_close, args, read_slots, write_slots, FP32_TOL, FP32_TOL)


def test_strided_views_of_conv_output(assert_close) -> None:
    """q, k and v as the model passes them: head views into one ``[B, 2*Hk*Dk + Hv*Dv]`` row."""
    num_seqs, num_k_heads, num_v_heads, k_dim, v_dim = 2, 2, 4, 16, 8
    q, k, v, g, beta, ssm_states = _inputs(num_seqs, num_k_heads, num_v_heads, k_dim, v_dim, seed=2)
    mixed = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
    key_dim = num_k_heads * k_dim
    q_view, k_view, v_view = torch.split(mixed, [key_dim, key_dim, num_v_heads * v_dim], dim=-1)
    views = (
        q_view.view(num_seqs, num_k_heads, k_dim),
        k_view.view(num_seqs, num_k_heads, k_dim),
        v_view.view(num_seqs, num_v_heads, v_dim),
    )
    assert not views[0].is_contiguous()
    slots = torch.tensor([3, 6], device=DEVICE)
    _check(assert_close, (*views, g, beta, ssm_states), slots, slots, FP32_TOL, FP32_TOL)


def _gate_inputs(num_seqs: int, num_v_heads: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Raw ``a``/``b`` projections (``b`` in the model dtype), ``A_log`` and ``dt_bias``; ``a`` spans
    softplus's linear branch (a + dt_bias > 20) too."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(num_seqs, num_v_heads, generator=gen) * 8).to(DEVICE, dtype)
    b = (torch.randn(num_seqs, num_v_heads, generator=gen) * 3).to(DEVICE, dtype)
    a_log = torch.randn(num_v_heads, generator=gen).to(DEVICE)
    dt_bias = (torch.randn(num_v_heads, generator=gen) * 10).to(DEVICE)
    return a, b, a_log, dt_bias


def _check_with_gates(assert_close, args, gates, read_slots, write_slots, out_tol, state_tol) -> None:
    q, k, v, _, _, ssm_states = args
    expected_states = ssm_states.clone()
    expected = reference_with_gates(q, k, v, *gates, expected_states, read_slots, write_slots)
    out = recurrent_gated_delta_rule_with_gates(q, k, v, *gates, ssm_states, read_slots, write_slots)
    assert_close(out, expected, **out_tol, msg="out")
    assert_close(ssm_states, expected_states, **state_tol, msg="states")


@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_gates_in_the_kernel_match_gdn_gates_then_the_step(assert_close, shape, same_slot) -> None:
    args = _inputs(*shape, seed=4)
    num_seqs = shape[0]
    read_slots = torch.arange(num_seqs, dtype=torch.int64, device=DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    gates = _gate_inputs(num_seqs, shape[2], torch.float32, seed=5)
    _check_with_gates(assert_close, args, gates, read_slots, write_slots, FP32_TOL, FP32_TOL)


def test_gates_in_the_kernel_round_beta_to_the_model_dtype(assert_close) -> None:
    """bf16 ``b``: beta is sigmoid(b) rounded to bf16 as ``gdn_gates`` returns it."""
    args = _inputs(2, 2, 4, 16, 16, dtype=torch.bfloat16, seed=6)
    gates = _gate_inputs(2, 4, torch.bfloat16, seed=7)
    slots = torch.tensor([1, 4], device=DEVICE)
    tol = {"atol": 3e-2, "rtol": 3e-2} if DEVICE.type == "cpu" else {}  # the interpreter truncates to bf16
    _check_with_gates(assert_close, args, gates, slots, slots, tol, FP32_TOL if DEVICE.type == "cuda" else tol)


def test_empty_batch() -> None:
    args = _inputs(0, 2, 4, 16, 16)
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert recurrent_gated_delta_rule(*args, slots, slots).shape == (0, 4, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("same_slot", [True, False], ids=["read_eq_write", "read_ne_write"])
@pytest.mark.parametrize("num_seqs", [1, 8, 61])
def test_qwen35_35b_a3b_shape_on_cuda(assert_close, num_seqs, same_slot, dtype) -> None:
    args = _inputs(num_seqs, 16, 32, 128, 128, dtype=dtype, num_slots=2 * num_seqs + 1, seed=3)
    read_slots = torch.randperm(num_seqs, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 2
    write_slots = read_slots if same_slot else read_slots + 1
    out_tol = FP32_TOL if dtype == torch.float32 else {}
    _check(assert_close, args, read_slots, write_slots, out_tol, FP32_TOL)
    gates = _gate_inputs(num_seqs, 32, dtype, seed=8)
    _check_with_gates(assert_close, args, gates, read_slots, write_slots, out_tol, FP32_TOL)
