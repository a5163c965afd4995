"""The decode attention with the QK-norm + RoPE + gate + KV-write prologue in its split launch
(``kernels.attention.triton_decode.paged_decode_attention_prologue``) against the torch references
(``kernels.attention.qk_norm_rope.qk_norm_rope_gate_store`` then ``kernels.attention.reference.paged_attention``) and
against the two Triton launches it replaces.

On CPU the kernels run under the Triton interpreter in fp32 (its ``tl.dot`` on bf16 operands is
wrong in Triton 3.6); the real shape runs in bf16 on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from paged_lists import PageLists

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.attention import triton_qk_norm_rope as qk_norm_rope  # noqa: E402
from phloem.kernels.attention.qk_norm_rope import qk_norm_rope_gate_store as reference_store  # noqa: E402
from phloem.kernels.attention.reference import paged_attention  # noqa: E402
from phloem.kernels.attention.rope import rope_inv_freq  # noqa: E402
from phloem.kernels.attention.triton_decode import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_prologue,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


class Step:
    """One decode step: a random history on shuffled pages, the step's q_gate / k / v as views of
    one fused projection row, and its slot (the last position of each sequence), left NaN so a
    read before the write would show."""

    def __init__(self, seq_lens, num_q_heads, num_kv_heads, head_dim, rotary_dim, page_size, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        pages = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages) + 1
        self.kv_cache = torch.randn((num_pages, 2, page_size, num_kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
        self.kv_cache[-1] = float("nan")  # never read: entries past nnz point at it
        order = torch.randperm(num_pages - 1, generator=gen).tolist()
        lists = PageLists(seq_lens, page_size, order, num_pages - 1, DEVICE)
        slots = []
        for ids, last in zip(lists.ids, lists.last):
            self.kv_cache[ids[-1], :, last - 1 :] = float("nan")  # the step's own slot and past the end
            slots.append(ids[-1] * page_size + last - 1)
        self.page_table = lists.page_table
        self.indices = (lists.kv_indptr, lists.kv_indices, lists.kv_last_page_len)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        self.positions = (self.seq_lens - 1).to(DEVICE, torch.int64)
        q, kv = num_q_heads * 2 * head_dim, num_kv_heads * head_dim
        qkv = (torch.randn(len(seq_lens), q + 2 * kv, generator=gen) * 2).to(DEVICE, dtype)
        q_gate, key, value = torch.split(qkv, [q, kv, kv], dim=-1)
        self.q_gate = q_gate.view(-1, num_q_heads, 2 * head_dim)
        self.key = key.view(-1, num_kv_heads, head_dim)
        self.value = value.view(-1, num_kv_heads, head_dim)
        self.q_norm_w = (torch.randn(head_dim, generator=gen) * 0.1).to(DEVICE, dtype)
        self.k_norm_w = (torch.randn(head_dim, generator=gen) * 0.1).to(DEVICE, dtype)
        self.inv_freq = rope_inv_freq(rotary_dim, 10_000_000.0).to(DEVICE)
        self.scale = head_dim**-0.5

    def norm_args(self) -> tuple[torch.Tensor, ...]:
        return self.q_gate, self.key, self.value, self.q_norm_w, self.k_norm_w, self.positions, self.inv_freq

    def fused(self, max_splits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = self.kv_cache.clone()
        out, gate = paged_decode_attention_prologue(
            *self.norm_args(), EPS, cache, self.slot_mapping, *self.indices, self.scale, max_splits
        )
        return out, gate, cache

    def two_launches(self, max_splits: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the fused launch replaces: the Triton QK-norm kernel, then the split-KV attention."""
        cache = self.kv_cache.clone()
        q, gate = qk_norm_rope.qk_norm_rope_gate_store(*self.norm_args(), EPS, cache, self.slot_mapping)
        return paged_decode_attention(q, cache, *self.indices, self.scale, max_splits), gate, cache

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = self.kv_cache.clone()
        q, gate = reference_store(*self.norm_args(), EPS, cache, self.slot_mapping)
        query_start_loc = torch.arange(len(self.seq_lens) + 1, dtype=torch.int32)
        out = paged_attention(q, cache, self.page_table.to(DEVICE), query_start_loc, self.seq_lens, self.scale)
        return out, gate, cache


# (seq_lens, (Hq, Hkv), head_dim, rotary_dim, page_size, max_splits): a one-key sequence (its only
# split writes and reads its own key), page edges, several splits with the new key in the last one,
# more splits than keys, the default split count.
CASES = {
    "B1-len1-direct": ([1], (2, 2), 16, 4, 4, 1),
    "B3-page-edges-direct": ([1, 16, 17], (4, 2), 32, 8, 16, 1),
    "B4-gqa2-3splits": ([1, 5, 37, 70], (4, 2), 32, 8, 4, 3),
    "B2-gqa4-more-splits-than-keys": ([3, 40], (4, 1), 16, 16, 4, 8),
    "B1-gqa8-default-splits-no-rotary": ([33], (8, 1), 32, 0, 16, None),
}


SLOW_CASES = {"B4-gqa2-3splits", "B2-gqa4-more-splits-than-keys"}  # over ~0.5 s under the Triton interpreter


@pytest.mark.parametrize(("seq_lens", "heads", "head_dim", "rotary", "page_size", "max_splits"),
                         [pytest.param(*case, marks=pytest.mark.slow) if name in SLOW_CASES else case
                          for name, case in CASES.items()], ids=CASES)
def test_matches_the_references_fp32(assert_close, decode_preload, seq_lens, heads, head_dim, rotary, page_size, max_splits) -> None:
    step = Step(seq_lens, *heads, head_dim, rotary, page_size, torch.float32, seed=len(seq_lens) + head_dim)
    out, gate, cache = step.fused(max_splits)
    ref_out, ref_gate, ref_cache = step.reference()
    assert_close(out, ref_out, atol=1e-5, rtol=1e-5, msg="out")
    assert_close(gate, ref_gate, exact=True, msg="gate")
    # Only the step's slots change (everything else, NaN past the ends included, is as it was).
    assert_close(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0), atol=1e-5, rtol=1e-5, msg="cache")
    # Against the two launches it replaces: the cache bit for bit (the same row code writes K and V).
    two_out, two_gate, two_cache = step.two_launches(max_splits)
    assert torch.equal(cache.nan_to_num(7.0), two_cache.nan_to_num(7.0))
    assert torch.equal(gate, two_gate)
    assert_close(out, two_out, atol=1e-6, rtol=1e-6, msg="out against the two launches")


def test_q_gate_may_be_a_contiguous_tensor(assert_close) -> None:
    """Not a view of the fused projection: unit strides throughout give the same result."""
    step = Step([9, 2], 4, 2, 16, 8, 4, torch.float32, seed=4)
    out, gate, _ = step.fused(2)
    step.q_gate, step.key, step.value = (t.contiguous() for t in (step.q_gate, step.key, step.value))
    again, gate_again, _ = step.fused(2)
    assert torch.equal(out, again) and torch.equal(gate, gate_again)


def _bad(case: str) -> dict[str, object]:
    step = Step([5, 9], 4, 2, 16, 8, 4, torch.float32)
    args: dict[str, object] = dict(
        q_gate=step.q_gate, key=step.key, value=step.value, q_norm_w=step.q_norm_w, k_norm_w=step.k_norm_w,
        positions=step.positions, inv_freq=step.inv_freq, eps=EPS, kv_cache=step.kv_cache,
        slot_mapping=step.slot_mapping, kv_indptr=step.indices[0], kv_indices=step.indices[1],
        kv_last_page_len=step.indices[2], scale=step.scale,
    )  # fmt: skip
    bad = {
        "q-gate-width": dict(q_gate=step.q_gate[..., :16]),
        "key-heads": dict(key=step.key[:, :1]),
        "value-shape": dict(value=step.value[:1]),
        "key-dtype": dict(key=step.key.double()),
        "norm-weight-shape": dict(q_norm_w=step.q_norm_w[:8]),
        "rotary-too-wide": dict(inv_freq=torch.ones(9, device=DEVICE)),
        "positions-shape": dict(positions=step.positions[:1]),
        "slot-mapping-shape": dict(slot_mapping=step.slot_mapping[:1]),
        "indptr-int64": dict(kv_indptr=step.indices[0].long()),
        "max-splits-zero": dict(max_splits=0),
    }
    return args | bad[case]


@pytest.mark.parametrize("case", ["q-gate-width", "key-heads", "value-shape", "key-dtype", "norm-weight-shape",
                                  "rotary-too-wide", "positions-shape", "slot-mapping-shape", "indptr-int64",
                                  "max-splits-zero"])  # fmt: skip
def test_rejects_inputs_it_does_not_cover(case: str) -> None:
    args = _bad(case)
    before = args["kv_cache"].clone()  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        paged_decode_attention_prologue(**args)  # type: ignore[arg-type]
    assert torch.equal(args["kv_cache"].nan_to_num(7.0), before.nan_to_num(7.0))  # type: ignore[union-attr]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("context", [1, 1024, 33000])
@pytest.mark.parametrize("num_seqs", [1, 16])
def test_real_shape_bf16_matches_the_two_launches(assert_close, decode_preload, num_seqs: int, context: int) -> None:
    """The 35B-A3B attention (16 query / 2 KV heads of 256, rotary 64, pages of 16): the cache and
    gate bit for bit, the output within bf16 rounding of the two launches' (the queries' norm
    reduces over a row in another order) and of the upcast reference."""
    seq_lens = [max(1, context - 37 * i) for i in range(num_seqs)]
    step = Step(seq_lens, 16, 2, 256, 64, 16, torch.bfloat16, seed=num_seqs)
    out, gate, cache = step.fused(None)
    two_out, two_gate, two_cache = step.two_launches(None)
    assert torch.equal(cache.nan_to_num(7.0), two_cache.nan_to_num(7.0))
    assert torch.equal(gate, two_gate)
    assert_close(out.float(), two_out.float(), atol=2e-2, rtol=2e-2)
    ref_out, _, _ = step.reference()
    assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=3e-2)
