"""FP8 KV pages through FlashInfer (``FlashInferAttention(kv_dtype=float8_e4m3fn)``) against the
torch reference reading the same pages (upcast to fp32): decode, prefill over a cached history,
a mixed step, and a CUDA-graph decode wrapper, at the Qwen3.5 attention shape (16 q / 2 KV heads
of 256, pages of 16). The Triton decode kernel reads only pages of the query's dtype, so with fp8
pages no plan may route to it. Tolerance: bf16 output, ``atol = rtol = 2e-2``.
"""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.attention.flashinfer import (
    FlashInferAttention, FlashInferPlan, MixedPlan, flashinfer_available,
)  # fmt: skip
from phloem.kernels.attention.reference import paged_attention, to_kv_dtype
from phloem.kernels.config import KernelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not flashinfer_available(), reason="needs a CUDA GPU and flashinfer")]

PAGE, HQ, HKV, D = 16, 16, 2, 256
SCALE = D**-0.5


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-wrapper"])
@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 1, 1], [13, 300, 40]),  # decode
    ([9, 5], [250, 5]),  # a chunk over a cached history, a fresh prompt
    ([1, 1, 9], [13, 30, 250]),  # mixed: decode rows beside a chunk
])  # fmt: skip
def test_fp8_pages_follow_the_reference(query_lens: list[int], seq_lens: list[int], graph: bool) -> None:
    if graph and any(n != 1 for n in query_lens):
        pytest.skip("only decode steps are captured")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    used = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(used) + 3, generator=gen).tolist()
    page_ids = [order[sum(used[:i]) : sum(used[: i + 1])] for i in range(len(used))]
    kv = to_kv_dtype(torch.randn(sum(used) + 3, 2, PAGE, HKV, D, generator=gen) * 3, torch.float8_e4m3fn).to(dev)
    q = torch.randn(sum(query_lens), HQ, D, generator=gen).to(dev, torch.bfloat16)
    attn = FlashInferAttention(HQ, HKV, D, PAGE, torch.bfloat16, dev, KernelConfig(triton_decode_attention=True),
                               kv_dtype=torch.float8_e4m3fn)
    assert not attn.triton_decode, "the Triton decode kernel does not read fp8 pages"
    plan = attn.plan(query_lens, seq_lens, page_ids, graph_batch_size=len(query_lens) if graph else None)
    assert isinstance(plan, (FlashInferPlan, MixedPlan))
    if isinstance(plan, MixedPlan):
        assert isinstance(plan.decode, FlashInferPlan)
    got = plan.run(q, kv)
    table = torch.zeros(len(page_ids), max(used), dtype=torch.int32)
    for i, ids in enumerate(page_ids):
        table[i, : len(ids)] = torch.tensor(ids)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    want = paged_attention(q, kv, table.to(dev), qsl.to(dev), torch.tensor(seq_lens, dtype=torch.int32).to(dev), SCALE)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
