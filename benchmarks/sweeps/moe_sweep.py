"""Sweep the decode MoE kernels' tiles on the GPU, timing CUDA-graph replays (not eager calls).

    python3 benchmarks/sweeps/moe_sweep.py [--out sweep.json] [--quick]

Shape: Qwen3.5-35B-A3B experts (256 routed + the shared one as expert 256, H=2048, I=512, bf16,
top-8 + shared). Each variant is captured once as a CUDA graph of ``LAYERS`` calls on distinct
layers' weights (so nothing is served from L2), replayed, and timed with CUDA events; a stage's
bytes are the distinct experts' weight bytes it reads. Every config is checked against the torch
reference before it is timed. Stage 1 (gate/up) and stage 2 (down + k-sum) are swept separately,
then the best pair is timed end to end. Last, the prefill grouped GEMM is timed on one 8K chunk
against the per-expert reference. Prints Markdown tables; ``--out`` writes the raw rows as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

from phloem.kernels.moe.reference import fused_moe as reference
from phloem.kernels.moe.reference import moe_route_shared
from phloem.kernels.moe.triton_decode import DEFAULT_CONFIG, MoeDecodeConfig, fused_moe_tuned, launch_down_sum, launch_gate_up
from phloem.kernels.moe.triton_grouped import fused_moe_grouped
from phloem.benchmarks.decode import graph_us

E, H, I, TOP_K, LAYERS = 257, 2048, 512, 8, 8


def make_layers(tokens: int, num_layers: int = LAYERS):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    layers = []
    for _ in range(num_layers):
        wgu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        wd = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        w, ids = moe_route_shared(torch.randn(tokens, E, device="cuda", generator=gen), TOP_K, True)
        act = torch.empty(tokens * (TOP_K + 1), I, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        layers.append((x, wgu, wd, w.contiguous(), ids.contiguous(), act, out))
    return layers


def check(layer, cfg: MoeDecodeConfig) -> None:
    x, wgu, wd, w, ids, _, _ = layer
    expected = reference(x.float(), wgu.float(), wd.float(), w.float(), ids)
    got = fused_moe_tuned(x, wgu, wd, w, ids, cfg).float()
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err < 2e-2, (cfg, err)


def stage1_grid(quick: bool) -> list[tuple[int, ...]]:
    grid = itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8), (1, 2, 3)) if not quick else [(8, 512, 2, 1)]
    return [g for g in grid if g[0] * g[1] <= 16384]


def stage2_grid(quick: bool) -> list[tuple[int, ...]]:
    grid = itertools.product((4, 8, 16, 32), (64, 128, 256, 512), (1, 2, 4, 8), (1, 2, 3)) if not quick else [(16, 128, 4, 1)]
    return [g for g in grid if 256 <= g[0] * g[1] <= 16384]


def _compile(job: tuple[int, list[tuple[int, ...]], list[tuple[int, ...]]]) -> int:
    """Compile configs into Triton's on-disk cache (a worker process; 9 experts suffice)."""
    _, g1, g2 = job
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    wgu = torch.randn(TOP_K + 1, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    wd = torch.randn(TOP_K + 1, H, I, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(TOP_K + 1, device="cuda").view(1, -1)
    w = torch.ones(1, TOP_K + 1, device="cuda")
    act = torch.empty(TOP_K + 1, I, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    for g in g1:
        launch_gate_up(x, wgu, ids, act, DEFAULT_CONFIG._replace(block_n1=g[0], block_k1=g[1], num_warps1=g[2], num_stages1=g[3]))
    for g in g2:
        launch_down_sum(act, wd, ids, w, out, DEFAULT_CONFIG._replace(block_n2=g[0], block_k2=g[1], num_warps2=g[2], num_stages2=g[3]))
    torch.cuda.synchronize()
    return len(g1) + len(g2)


def precompile(quick: bool, jobs: int) -> None:
    import multiprocessing as mp

    g1, g2 = stage1_grid(quick), stage2_grid(quick)
    work = [(j, g1[j::jobs], g2[j::jobs]) for j in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile, work)


def sweep_stage1(layers, quick: bool):
    rows = []
    for bn, bk, nw, ns in stage1_grid(quick):
        cfg = DEFAULT_CONFIG._replace(block_n1=bn, block_k1=bk, num_warps1=nw, num_stages1=ns)
        fn = lambda: [launch_gate_up(L[0], L[1], L[4], L[5], cfg) for L in layers]  # noqa: E731
        rows.append((graph_us(fn, LAYERS), (bn, bk, nw, ns)))
    return sorted(rows)


def sweep_stage2(layers, quick: bool):
    rows = []
    for bn, bk, nw, ns in stage2_grid(quick):
        cfg = DEFAULT_CONFIG._replace(block_n2=bn, block_k2=bk, num_warps2=nw, num_stages2=ns)
        fn = lambda: [launch_down_sum(L[5], L[2], L[4], L[3], L[6], cfg) for L in layers]  # noqa: E731
        rows.append((graph_us(fn, LAYERS), (bn, bk, nw, ns)))
    return sorted(rows)


def decode_rows(tokens: int, quick: bool) -> list[dict]:
    layers = make_layers(tokens)
    distinct = sum(L[4].unique().numel() for L in layers) / LAYERS
    s1 = sweep_stage1(layers, quick)
    s2 = sweep_stage2(layers, quick)
    best = MoeDecodeConfig(*s1[0][1], *s2[0][1])
    check(layers[0], best)
    check(layers[0], DEFAULT_CONFIG)
    both = lambda cfg: lambda: [fused_moe_tuned(L[0], L[1], L[2], L[3], L[4], cfg) for L in layers]  # noqa: E731
    gb = distinct * 3 * H * I * 2 / 1e9
    out = []
    for name, cfg in (("best", best), ("default", DEFAULT_CONFIG)):
        us = graph_us(both(cfg), LAYERS)
        s1_us = next(t for t, g in s1 if g == tuple(cfg[:4]))
        s2_us = next(t for t, g in s2 if g == tuple(cfg[4:]))
        out.append(dict(tokens=tokens, distinct=distinct, which=name, config=list(cfg), us=us, tbps=gb * 1e3 / us,
                        stage1_us=s1_us, stage1_tbps=gb * 2 / 3 * 1e3 / s1_us,
                        stage2_us=s2_us, stage2_tbps=gb / 3 * 1e3 / s2_us,
                        stage1_top=s1[:5], stage2_top=s2[:5]))  # fmt: skip
    del layers
    torch.cuda.empty_cache()
    return out


def prefill_row(tokens: int = 8192) -> dict:
    (x, wgu, wd, w, ids, _, _), = make_layers(tokens, num_layers=1)
    expected = reference(x, wgu, wd, w, ids)
    got = fused_moe_grouped(x, wgu, wd, w, ids)
    err = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    timings = {}
    for name, fn in (("reference", lambda: reference(x, wgu, wd, w, ids)), ("grouped", lambda: fused_moe_grouped(x, wgu, wd, w, ids))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - t0) / 3 * 1000
    flops = 2 * tokens * (TOP_K + 1) * 3 * H * I
    return dict(tokens=tokens, rel_err=err, ms=timings, grouped_tflops=flops / (timings["grouped"] * 1e-3) / 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the raw rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="one config per stage (a smoke run)")
    parser.add_argument("--tokens", default="1,4,16", help="comma-separated decode batch sizes")
    parser.add_argument("--jobs", type=int, default=8, help="processes that pre-compile the configs")
    args = parser.parse_args()
    t0 = time.time()
    if args.jobs > 1:
        precompile(args.quick, args.jobs)
        print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    rows = [r for t in args.tokens.split(",") for r in decode_rows(int(t), args.quick)]
    prefill = prefill_row()
    print("| tokens | distinct experts | which | µs/layer | TB/s | gate/up µs (TB/s) | down+sum µs (TB/s) | config |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['distinct']:.1f} | {r['which']} | {r['us']:.1f} | {r['tbps']:.2f} | "
              f"{r['stage1_us']:.1f} ({r['stage1_tbps']:.2f}) | {r['stage2_us']:.1f} ({r['stage2_tbps']:.2f}) | {tuple(r['config'])} |")  # fmt: skip
    print(f"prefill MoE, {prefill['tokens']} tokens: reference {prefill['ms']['reference']:.1f} ms, grouped "
          f"{prefill['ms']['grouped']:.1f} ms ({prefill['grouped_tflops']:.0f} TFLOP/s), rel err {prefill['rel_err']:.1e}")  # fmt: skip
    print(f"sweep took {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"decode": rows, "prefill": prefill}, f, indent=1)


if __name__ == "__main__":
    main()
