"""Time the split-KV paged decode attention (``kernels/attention/triton_decode.py``) against
FlashInfer's tensor-core decode on the GPU, at the 35B-A3B attention shape (Hq 16, Hkv 2, D 256,
bf16, pages of 16).

    python3 benchmarks/sweeps/decode_attention_bench.py --out decode_attention.json [--sweep]
    TRITON_INTERPRET=1 python3 benchmarks/sweeps/decode_attention_bench.py --smoke   # CPU: tiny shapes, checks only

For batch 1/4/16 at 1K/32K/128K context (every sequence the same length, pages shuffled), each
kernel is (i) checked against the fp32 torch reference (and FlashInfer against ours), then (ii)
timed from a CUDA graph of 10 calls, each on another KV cache (as many distinct caches as fit in
~40 GB, at least 2, so L2 does not serve the repeats), replayed 20 times: µs per call and K+V
bytes over that time. (iii) times ``max_splits`` choices at batch 1 (1K, 128K) and batch 16 (32K)
to tune ``default_max_splits``; ``--sweep`` adds launch configurations (tokens per tile, warps,
stages). Prints a table last; ``--out`` writes every row as JSON. ``--smoke`` runs tiny shapes
through the same checks (fp32: the interpreter's bf16 ``tl.dot`` is wrong) and times nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels import (kernels/__init__.py)

from phloem.kernels.attention import triton_decode as da  # noqa: E402
from phloem.kernels.attention.reference import paged_attention  # noqa: E402
from phloem.kernels.common.device import num_sms  # noqa: E402

CALLS, REPEATS, CACHE_BUDGET = 10, 20, 40e9


@dataclass(frozen=True, slots=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


MODEL = Shape(16, 2, 256, 16, torch.bfloat16)
TINY = Shape(4, 2, 32, 4, torch.float32)


class Batch:
    """``num_seqs`` sequences of ``context`` tokens on shuffled pages, over ``num_caches`` KV caches."""

    def __init__(self, shape: Shape, num_seqs: int, context: int, num_caches: int, device: torch.device) -> None:
        self.shape, self.num_seqs, self.context = shape, num_seqs, context
        pages_per_seq = -(-context // shape.page_size)
        num_pages = num_seqs * pages_per_seq
        gen = torch.Generator(device=device).manual_seed(num_seqs * 1000003 + context)
        cache_shape = (num_pages, 2, shape.page_size, shape.num_kv_heads, shape.head_dim)
        first = torch.randn(cache_shape, device=device, dtype=shape.dtype, generator=gen)
        # Distinct memory for each call; the values need not differ.
        self.caches = [first] + [first.clone() for _ in range(num_caches - 1)]
        self.page_table = torch.randperm(num_pages, device=device, generator=gen).int().view(num_seqs, pages_per_seq)
        self.indptr = torch.arange(0, num_pages + 1, pages_per_seq, dtype=torch.int32, device=device)
        self.indices = self.page_table.flatten().contiguous()
        last = context - (pages_per_seq - 1) * shape.page_size
        self.last = torch.full((num_seqs,), last, dtype=torch.int32, device=device)
        q_shape = (num_seqs, shape.num_q_heads, shape.head_dim)
        self.q = torch.randn(q_shape, device=device, dtype=shape.dtype, generator=gen)
        self.scale = shape.head_dim**-0.5

    @property
    def kv_bytes(self) -> int:
        s = self.shape
        return self.num_seqs * self.context * 2 * s.num_kv_heads * s.head_dim * s.dtype.itemsize

    def ours(self, kv: torch.Tensor, max_splits: int | None = None, config: da.DecodeAttentionConfig | None = None):
        c = config or da.DecodeAttentionConfig()
        return da.paged_decode_attention_tuned(
            self.q, kv, self.indptr, self.indices, self.last, self.scale, max_splits, None, c
        )

    def reference(self) -> torch.Tensor:
        """fp32 (the cache stays in its dtype: the reference upcasts one sequence at a time)."""
        seq_lens = torch.full((self.num_seqs,), self.context, dtype=torch.int32)
        query_start_loc = torch.arange(self.num_seqs + 1, dtype=torch.int32)
        return paged_attention(self.q.float(), self.caches[0], self.page_table, query_start_loc, seq_lens, self.scale)


def num_caches(shape: Shape, num_seqs: int, context: int) -> int:
    one = num_seqs * context * 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    return int(max(2, min(CALLS, CACHE_BUDGET // one)))


def flashinfer_decode(batch: Batch):
    """A planned fixed-buffer (graph-safe) FlashInfer decode wrapper's ``run``."""
    import flashinfer

    s, dev = batch.shape, batch.q.device
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
        use_tensor_cores=True, paged_kv_indptr_buffer=torch.empty_like(batch.indptr),
        paged_kv_indices_buffer=torch.empty_like(batch.indices),
        paged_kv_last_page_len_buffer=torch.empty_like(batch.last),
    )  # fmt: skip
    wrapper.plan(
        batch.indptr.cpu(), batch.indices, batch.last.cpu(), s.num_q_heads, s.num_kv_heads, s.head_dim, s.page_size,
        q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=batch.scale,
    )  # fmt: skip
    return lambda kv: wrapper.run(batch.q, kv)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def timed(batch: Batch, call) -> float | None:
    """µs per call from a graph of ``CALLS`` calls cycling over the caches, the median of three
    graphs (None on CPU)."""
    if batch.q.device.type != "cuda":
        call(batch.caches[0])
        return None
    from phloem.benchmarks.decode import graph_us

    kvs = list(itertools.islice(itertools.cycle(batch.caches), CALLS))
    return statistics.median(graph_us(lambda: [call(kv) for kv in kvs], CALLS, REPEATS) for _ in range(3))


def row(batch: Batch, impl: str, us: float | None, **extra: object) -> dict:
    tb_s = batch.kv_bytes / us / 1e6 if us else None
    return {"batch": batch.num_seqs, "context": batch.context, "impl": impl, "us": us, "tb_s": tb_s, **extra}


def main_grid(shape: Shape, batches, contexts, with_flashinfer: bool) -> list[dict]:
    rows = []
    for num_seqs, context in itertools.product(batches, contexts):
        batch = Batch(shape, num_seqs, context, num_caches(shape, num_seqs, context), batch_device())
        got = batch.ours(batch.caches[0])
        ref_err = max_abs(got, batch.reference())
        splits = da.default_max_splits(num_seqs, shape.num_kv_heads, num_sms(batch.q.device))
        rows.append(row(batch, "triton", timed(batch, batch.ours), max_splits=splits, ref_max_abs=ref_err))
        if with_flashinfer:
            fi = flashinfer_decode(batch)
            fi_out = fi(batch.caches[0])
            ref_err, fi_diff = max_abs(fi_out, batch.reference()), max_abs(fi_out, got)
            rows.append(row(batch, "flashinfer", timed(batch, fi), ref_max_abs=ref_err, vs_triton_max_abs=fi_diff))
        for r in rows[-2 if with_flashinfer else -1 :]:
            print(json.dumps(r), flush=True)
        del batch
        release_memory()
    return rows


SPLIT_CASES = {
    (1, 1024): (32, 64, 128, 256), (1, 32768): (64, 128, 256), (1, 131072): (64, 128, 256),
    (4, 32768): (32, 64, 66), (4, 131072): (32, 64, 66), (16, 1024): (8, 16, 32), (16, 32768): (8, 16, 17),
}  # fmt: skip
SWEEP = [da.DecodeAttentionConfig(*c) for c in ((16, 4, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 8, 2))]


def splits_grid(shape: Shape, cases: dict, configs: list[da.DecodeAttentionConfig]) -> list[dict]:
    rows = []
    for (num_seqs, context), choices in cases.items():
        batch = Batch(shape, num_seqs, context, num_caches(shape, num_seqs, context), batch_device())
        want = batch.reference()
        for config, splits in itertools.product(configs, choices):
            err = max_abs(batch.ours(batch.caches[0], splits, config), want)
            us = timed(batch, lambda kv: batch.ours(kv, splits, config))
            rows.append(row(batch, "triton", us, max_splits=splits, config=list(config), ref_max_abs=err))
            print(json.dumps(rows[-1]), flush=True)
        del batch
        release_memory()
    return rows


def release_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batch_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["| batch | context | impl | max_splits | config (block_t, warps, stages) | µs | TB/s | max abs vs ref |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['impl']} | {r.get('max_splits', '-')} "
            f"| {r.get('config', 'default')} "
            f"| {fmt(r['us'], '.1f')} | {fmt(r['tb_s'], '.2f')} | {fmt(r['ref_max_abs'], '.2e')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write every row as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, checks only (CPU, TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations in (iii)")
    parser.add_argument("--no-flashinfer", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        rows = main_grid(TINY, (1, 2), (5, 40), with_flashinfer=False)
        rows += splits_grid(TINY, {(1, 40): (1, 3, 16)}, [da.DecodeAttentionConfig()])
        bad = [r for r in rows if r["ref_max_abs"] > 1e-5]
    else:
        assert torch.cuda.is_available(), "needs a CUDA GPU (or --smoke)"
        rows = main_grid(MODEL, (1, 4, 16), (1024, 32768, 131072), with_flashinfer=not args.no_flashinfer)
        rows += splits_grid(MODEL, SPLIT_CASES, SWEEP if args.sweep else [da.DecodeAttentionConfig()])
        bad = [r for r in rows if r["ref_max_abs"] > 2e-2]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    assert not bad, f"outputs off the reference: {bad}"


if __name__ == "__main__":
    main()
