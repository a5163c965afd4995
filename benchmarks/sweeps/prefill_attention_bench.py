"""FlashInfer's paged prefill attention for the steps an agent server runs: a tool result's chunk
(hundreds of tokens) over a long history, beside a batch of decode rows, and a first turn's 8K
chunks, at the 35B-A3B attention shape (16 query heads, 2 KV heads, head_dim 256, pages of 16).

    python3 benchmarks/sweeps/prefill_attention_bench.py [--ragged-only]

For each case: FlashInfer's ``auto`` backend (FA3 on Hopper) and ``fa2`` (which splits long KV
over CTAs), the whole step in one prefill call; the decode rows alone in the decode wrapper; and
for a chunk alone, FA3 with the history split by hand into ``--segments`` non-causal requests
(the chunk's queries repeated) plus the causal tail, merged by their log-sum-exps
(``flashinfer.merge_states``). Device µs per call (CUDA events, mean of ``--repeats`` after
warm-ups) and the fraction of the bf16 matmul peak the FLOPs reach.

A second table asks whether the appends' prefill can leave the paged kernel (whose SM90 path loads
K/V pages with ``cp.async``, not TMA): for a chunk alone over shuffled pages, the history gathered
into contiguous bf16 K and V (``gather_pages``, torch's ``index_select``; fp8 pages upcast in the
same pass) and FlashInfer's ragged FA3 over them, against the paged FA3 call (bf16 pages) and the
paged FA2 call fp8 pages take today (FA3 reads fp8 KV only with an fp8 query). The gather's
scratch is one layer's history (``kv_len · 2 · HKV · D`` bf16), reused by every layer.
"""

from __future__ import annotations

import argparse
import sys

import torch

HQ, HKV, D, PAGE = 16, 2, 256, 16


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def _layout(query_lens: list[int], kv_lens: list[int]):
    pages = [(n + PAGE - 1) // PAGE for n in kv_lens]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    qo = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return qo, indptr, indices, last, int(indptr[-1])


def prefill_us(backend: str, query_lens: list[int], kv_lens: list[int], repeats: int) -> float:
    import flashinfer

    device = torch.device("cuda")
    qo, indptr, indices, last, num_pages = _layout(query_lens, kv_lens)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    wrapper.plan(qo, indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, sm_scale=D**-0.5)
    q = torch.randn(sum(query_lens), HQ, D, dtype=torch.bfloat16, device=device)
    kv = torch.randn(num_pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device=device)
    return _time(lambda: wrapper.run(q, kv), repeats)


def gather_pages(kv: torch.Tensor, indices: torch.Tensor, kv_len: int,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``kv_len`` keys and values of the pages ``indices`` of ``kv``
    ``[num_pages, 2, PAGE, HKV, D]`` as contiguous ``[kv_len, HKV, D]`` tensors of ``dtype``."""
    k, v = (kv[:, i].index_select(0, indices).flatten(0, 1)[:kv_len].to(dtype) for i in (0, 1))
    return k, v


def gather_ragged_us(query_len: int, kv_len: int, kv_dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """One chunk of ``query_len`` (the last of ``kv_len`` keys, causal) over shuffled pages of
    ``kv_dtype``: µs of the paged call the served path makes today (FA3 for bf16 pages, FA2 for
    fp8), of the gather alone, of ragged FA3 alone over the gathered bf16 history and of both, and
    the largest difference between the ragged and the paged outputs."""
    import flashinfer

    device = torch.device("cuda")
    num_pages = (kv_len + PAGE - 1) // PAGE
    indices = torch.randperm(2 * num_pages, device=device)[:num_pages].to(torch.int32)
    kv = torch.randn(2 * num_pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device=device).to(kv_dtype)
    q = torch.randn(query_len, HQ, D, dtype=torch.bfloat16, device=device)
    common = dict(causal=True, q_data_type=torch.bfloat16, sm_scale=D**-0.5)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD",
        backend="fa3" if kv_dtype == torch.bfloat16 else "fa2")
    paged.plan(torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([0, num_pages], dtype=torch.int32),
               indices, torch.tensor([kv_len - (num_pages - 1) * PAGE], dtype=torch.int32), HQ, HKV, D, PAGE,
               kv_data_type=kv_dtype, **common)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=device), "NHD", backend="fa3")
    ragged.plan(torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                HQ, HKV, D, kv_data_type=torch.bfloat16, **common)
    k, v = gather_pages(kv, indices, kv_len)
    err = float((ragged.run(q, k, v).float() - paged.run(q, kv).float()).abs().max())
    return {
        "paged": _time(lambda: paged.run(q, kv), repeats),
        "gather": _time(lambda: gather_pages(kv, indices, kv_len), repeats),
        "ragged": _time(lambda: ragged.run(q, k, v), repeats),
        "both": _time(lambda: ragged.run(q, *gather_pages(kv, indices, kv_len)), repeats),
        "err": err,
    }


def fa3_split_us(query_len: int, kv_len: int, segments: int, repeats: int) -> tuple[float, float]:
    """One chunk of ``query_len`` over ``kv_len`` keys: history pages in ``segments`` non-causal
    FA3 requests, the page-aligned tail with the chunk causal, then one merge of the states.
    Returns µs per call and the largest difference from one causal FA3 call over the same pages."""
    import flashinfer

    device = torch.device("cuda")
    hist_pages = (kv_len - query_len) // PAGE
    tail = kv_len - hist_pages * PAGE
    per = [(hist_pages + segments - 1 - s) // segments for s in range(segments)]
    num_pages = hist_pages + (tail + PAGE - 1) // PAGE
    kv = torch.randn(num_pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device=device)
    q = torch.randn(query_len, HQ, D, dtype=torch.bfloat16, device=device)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    common = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D**-0.5)
    hist = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
    kv_indptr = torch.tensor([0, *torch.tensor(per).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.arange(segments + 1, dtype=torch.int32) * query_len
    hist.plan(qo_indptr, kv_indptr, torch.arange(hist_pages, dtype=torch.int32),
              torch.full((segments,), PAGE, dtype=torch.int32), HQ, HKV, D, PAGE, causal=False, **common)
    workspace2 = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    own = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace2, "NHD", backend="fa3")
    tail_pages = num_pages - hist_pages
    own.plan(torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([0, tail_pages], dtype=torch.int32),
             torch.arange(hist_pages, num_pages, dtype=torch.int32),
             torch.tensor([tail - (tail_pages - 1) * PAGE], dtype=torch.int32), HQ, HKV, D, PAGE, causal=True,
             **common)
    q_rep = q.repeat(segments, 1, 1)

    def step() -> torch.Tensor:
        v_h, s_h = hist.run(q_rep, kv, return_lse=True)
        v_t, s_t = own.run(q, kv, return_lse=True)
        v = torch.cat([v_h.view(segments, query_len, HQ, D).transpose(0, 1), v_t.unsqueeze(1)], dim=1)
        s = torch.cat([s_h.view(segments, query_len, HQ).transpose(0, 1), s_t.unsqueeze(1)], dim=1)
        return flashinfer.merge_states(v.contiguous(), s.contiguous())[0]

    full = flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty_like(workspace), "NHD", backend="fa3")
    full.plan(torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([0, num_pages], dtype=torch.int32),
              torch.arange(num_pages, dtype=torch.int32), torch.tensor([tail - (tail_pages - 1) * PAGE], dtype=torch.int32),
              HQ, HKV, D, PAGE, causal=True, **common)
    err = float((step().float() - full.run(q, kv).float()).abs().max())
    return _time(step, repeats), err


def decode_us(batch: int, kv_len: int, repeats: int) -> float:
    import flashinfer

    device = torch.device("cuda")
    _, indptr, indices, last, num_pages = _layout([1] * batch, [kv_len] * batch)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                 sm_scale=D**-0.5)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=device)
    kv = torch.randn(num_pages, 2, PAGE, HKV, D, dtype=torch.bfloat16, device=device)
    return _time(lambda: wrapper.run(q, kv), repeats)


def flops(query_lens: list[int], kv_lens: list[int]) -> float:
    # Causal: query i of a chunk of n over a history of L - n attends to L - n + i + 1 keys.
    keys = sum(q * (kv - q) + q * (q + 1) / 2 for q, kv in zip(query_lens, kv_lens))
    return 4 * HQ * D * keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--segments", type=int, default=4, help="history segments of the hand-split FA3")
    parser.add_argument("--ragged-only", action="store_true", help="the second table alone")
    args = parser.parse_args()
    cases = []
    for context in (32768, 57344):
        for chunk in (800, 2048):
            cases.append((f"{chunk} @ {context // 1024}K + {args.decodes} decodes",
                          [chunk] + [1] * args.decodes, [context] + [context] * args.decodes))
            cases.append((f"{chunk} @ {context // 1024}K alone", [chunk], [context]))
    cases.append(("8192 @ 8K (first chunk)", [8192], [8192]))
    cases.append(("8192 @ 48K (late chunk)", [8192], [49152]))
    peak = 790e12
    if not args.ragged_only:
        print(f"{'case':<30}{'auto µs':>10}{'fa2 µs':>10}{'fa3 split µs':>14}{'decode µs':>11}{'auto %':>8}"
              f"{'fa2 %':>8}{'split %':>9}")
    for name, qs, kvs in [] if args.ragged_only else cases:
        auto = prefill_us("auto", qs, kvs, args.repeats)
        fa2 = prefill_us("fa2", qs, kvs, args.repeats)
        dec = decode_us(len(qs) - 1, kvs[-1], args.repeats) if len(qs) > 1 else 0.0
        split, err = fa3_split_us(qs[0], kvs[0], args.segments, args.repeats) if len(qs) == 1 and kvs[0] > qs[0] \
            else (0.0, 0.0)
        f = flops(qs, kvs)

        def pct(us: float) -> str:
            return f"{100 * f / (us * 1e-6) / peak:.0f}%" if us else "-"

        print(f"{name:<30}{auto:>10.0f}{fa2:>10.0f}{split:>14.0f}{dec:>11.0f}{pct(auto):>8}{pct(fa2):>8}"
              f"{pct(split):>9}" + (f"  (split max |diff| {err:.2g})" if split else ""), flush=True)
    print(f"\n{'chunk alone, pages':<30}{'paged µs':>10}{'gather µs':>11}{'ragged µs':>11}{'both µs':>10}"
          f"{'paged %':>9}{'both %':>8}  max |diff|")
    for name, qs, kvs in cases:
        if len(qs) > 1 or kvs[0] == qs[0]:
            continue
        f = flops(qs, kvs)
        for label, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            r = gather_ragged_us(qs[0], kvs[0], kv_dtype, args.repeats)
            print(f"{name + ', ' + label:<30}{r['paged']:>10.0f}{r['gather']:>11.0f}{r['ragged']:>11.0f}"
                  f"{r['both']:>10.0f}{100 * f / (r['paged'] * 1e-6) / peak:>8.0f}%"
                  f"{100 * f / (r['both'] * 1e-6) / peak:>7.0f}%  {r['err']:.2g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
