"""A mixed step's attention in two calls (``kernels.attention.flashinfer.MixedPlan``): the leading
one-token decode rows through the split-KV Triton decode kernel (interpreter on CPU, fp32), the
prefill chunks through the prefill call, against the torch reference over every row at once.

FlashInfer does not run on CPU: the prefill call here is a stand-in wrapper that runs the torch
reference over its own rows and page lists (the same interface ``FlashInferPlan`` calls), so
what is tested is the split: which rows and page lists go to which call, and the joined output.
"""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.attention.flashinfer import FlashInferPlan, MixedPlan, TritonDecodePlan, page_indices
from phloem.kernels.attention.reference import paged_attention

PAGE, HQ, HKV, D = 4, 4, 2, 16
SCALE = D**-0.5


def _page_table(page_ids: list[list[int]]) -> torch.Tensor:
    table = torch.zeros(len(page_ids), max(len(p) for p in page_ids), dtype=torch.int32)
    for i, ids in enumerate(page_ids):
        table[i, : len(ids)] = torch.tensor(ids)
    return table


class ReferencePrefill:
    """Stands in for FlashInfer's prefill wrapper: causal attention of its requests' rows."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], page_ids: list[list[int]]) -> None:
        self.qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.table = _page_table(page_ids)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert q.shape[0] == int(self.qsl[-1]), "the prefill call got another call's rows"
        return paged_attention(q, kv_cache, self.table, self.qsl, self.seq_lens, SCALE)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 1, 1, 9], [13, 2, 30, 25]),  # three decode rows beside a chunk over history
    ([1, 5, 1, 7], [6, 5, 9, 40]),  # a one-token prefill row after the chunk stays in the prefill call
    ([1, 3], [1, 3]),  # a first token decoding beside a fresh prompt
])  # fmt: skip
def test_split_rows_give_the_one_call_reference(query_lens: list[int], seq_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    used = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(used) + 3, generator=gen).tolist()  # shuffled pages, some unused
    page_ids = []
    for u in used:
        page_ids.append(order[:u])
        order = order[u:]
    kv_cache = torch.randn(sum(used) + 3, 2, PAGE, HKV, D, generator=gen)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen)
    n = next(i for i, length in enumerate(query_lens) if length != 1)
    decode = TritonDecodePlan(*page_indices(page_ids[:n], seq_lens[:n], PAGE), SCALE)
    prefill = FlashInferPlan(ReferencePrefill(query_lens[n:], seq_lens[n:], page_ids[n:]))
    got = MixedPlan(n, decode, prefill).run(q, kv_cache)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = paged_attention(q, kv_cache, _page_table(page_ids), qsl, torch.tensor(seq_lens), SCALE)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
