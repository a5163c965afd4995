"""Time the one-token GEMVs with their weight tiles staged through shared memory (``gemv.GemvConfig``
with ``num_stages > 1``: ``cp.async`` stages issued before ``gdc_wait``) against the register walk
the decode step runs, on the GPU: CUDA-graph replays over distinct weights (nothing served from L2),
as ``gemv_sweep.py``, under programmatic dependent launch where the GPU has it.

    python3 docs/bench/gemv_staged_sweep.py [--out staged.json] [--env-out best.env] [--quick]

Pass 1: the plain GEMV at the five 35B-A3B decode shapes, every staged configuration of the grid
against ``gemv_config``'s register walk and cuBLAS. Pass 2: the fused projections (in_proj + conv,
qkv, the gated-norm and sigmoid-gate out projections, the router) with the best staged
configurations of their shape against their register walk. Every configuration is checked against
an fp32 reference before it is timed. Prints a Markdown table last; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gemv_sweep import DT, SHAPES, check, fused_cases, weights  # noqa: E402

from phloem.kernels.triton import gemv  # noqa: E402
from phloem.kernels.triton._device import balanced_grid  # noqa: E402
from phloem.runtime.bench_decode import graph_us, measure_bandwidth  # noqa: E402

SMEM = 220 * 1024  # shared memory an SM offers a grid's programs (of 227 KB), with room for the reduce


def staged_configs(num_k: int, quick: bool) -> list[gemv.GemvConfig]:
    kp = 1 << (num_k - 1).bit_length()
    if quick:
        grid = [(4, 8, 3, 2), (4, 8, 4, 3)]
    else:
        grid = list(itertools.product((2, 4, 8), (4, 8), (2, 3, 4), (1, 2, 4)))
    out = []
    for bn, w, st, pps in grid:
        bn = min(bn, 16384 // kp)
        # Triton keeps num_stages - 1 tiles of [block_n, kp] bf16 in shared memory a program.
        if (st - 1) * bn * kp * 2 * pps <= SMEM:
            out.append(gemv.GemvConfig(bn, w, st, pps, False))
    return list(dict.fromkeys(out))


def _compile(todo: list[tuple[str, tuple]]) -> int:
    """Compile plain-GEMV configs into Triton's on-disk cache (a worker process)."""
    for name, c in todo:
        n, k = SHAPES[name]
        gemv.linear_tuned(torch.randn(1, k, device="cuda", dtype=DT), torch.randn(n, k, device="cuda", dtype=DT), gemv.GemvConfig(*c))
    torch.cuda.synchronize()
    return len(todo)


def _row(name: str, variant: str, c: gemv.GemvConfig | None, us: float, nbytes: int, bandwidth: float) -> dict:
    return {"shape": name, "variant": variant, "config": list(c) if c else None, "us": us,
            "tb_s": nbytes / us / 1e6, "fraction": nbytes / us / 1e-6 / bandwidth}  # fmt: skip


def sweep_plain(quick: bool, jobs: int, bandwidth: float) -> list[dict]:
    todo = [(name, tuple(c)) for name, (_, k) in SHAPES.items() for c in staged_configs(k, quick or name == "lm_head")]
    with mp.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile, [todo[j::jobs] for j in range(jobs)])
    rows = []
    for name, (n, k) in SHAPES.items():
        ws, nbytes = weights(name), n * k * 2
        x = torch.randn(1, k, device="cuda", dtype=DT)
        want = F.linear(x.float(), ws[0].float())
        timed = [("cuBLAS", None, lambda w: F.linear(x, w)), ("register", gemv.gemv_config(n, k), None)]
        timed += [("staged", c, None) for c in staged_configs(k, quick or name == "lm_head")]
        for variant, c, call in timed:
            call = call or (lambda w, c=c: gemv.linear_tuned(x, w, c))
            check(call(ws[0]), want, (name, variant, c))
            rows.append(_row(name, variant, c, graph_us(lambda call=call: [call(w) for w in ws], len(ws)), nbytes, bandwidth))
        base = next(r for r in rows if r["shape"] == name and r["variant"] == "register")
        print(f"{name}: register {base['us']:.2f} us, best staged {_best(rows, name, 1)[0]}", flush=True)
    return rows


def _best(rows: list[dict], name: str, top: int) -> list[dict]:
    return sorted((r for r in rows if r["shape"] == name and r["variant"] == "staged"), key=lambda r: r["us"])[:top]


def _walk(num_n: int, c: gemv.GemvConfig) -> int:
    """Row blocks a program walks (as ``gemv._launch`` sizes the grid)."""
    blocks = -(-num_n // c.block_n)
    grid = balanced_grid(blocks, c.programs_per_sm, torch.device("cuda"))
    return -(-blocks // grid)


def sweep_fused(plain: list[dict], bandwidth: float) -> list[dict]:
    rows = []
    for name in ("in_proj", "qkv_proj", "out_proj", "router"):
        ws, (n, k) = weights(name), SHAPES[name]
        tops = [gemv.gemv_config(n, k, name == "in_proj")] + [gemv.GemvConfig(*r["config"]) for r in _best(plain, name, 8)]
        if name == "in_proj":  # the staged walk takes the conv where a program keeps its conv rows (16 blocks at most)
            tops = [c for c in tops if c.num_stages == 1 or _walk(n, c) <= 16][:5]
        tops = tops[:5]
        for variant, fused, _, reference in fused_cases(name, ws):
            for c in dict.fromkeys(tops):
                original = gemv.gemv_config
                gemv.gemv_config = lambda n_, k_, conv=False, c=c: c  # the fused ops take their tiles from here
                try:
                    want = reference(ws[0])  # before a conv call updates its state in place
                    check(fused(ws[0]), want, (variant, c))
                    us = graph_us(lambda fused=fused: [fused(w) for w in ws], len(ws))
                finally:
                    gemv.gemv_config = original
                kind = "staged" if c.num_stages > 1 else "register"
                rows.append(_row(name, f"{variant} ({kind})", c, us, n * k * 2, bandwidth))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--env-out", type=Path, help="write PHLOEM_GEMV_SHAPE_CONFIG of the best staged tiles here")
    args = ap.parse_args()
    bandwidth = measure_bandwidth(torch.device("cuda"))
    plain = sweep_plain(args.quick, args.jobs, bandwidth)
    fused = sweep_fused(plain, bandwidth)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.3f} TB/s\n")
    print("| shape | variant | config (block_n, warps, stages, programs/SM, prefetch) | µs | TB/s | of copy bw |")
    print("|---|---|---|---|---|---|")
    for name in SHAPES:
        mine = [r for r in plain if r["shape"] == name]
        for r in [r for r in mine if r["variant"] != "staged"] + _best(plain, name, 3) + [r for r in fused if r["shape"] == name]:
            print(f"| {name} | {r['variant']} | {r['config']} | {r['us']:.2f} | {r['tb_s']:.2f} | {r['fraction']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps({"bandwidth": bandwidth, "rows": plain + fused}, indent=1))
    if args.env_out:
        args.env_out.write_text(f"PHLOEM_GEMV_SHAPE_CONFIG={best_env(fused)}\n")


def best_env(fused: list[dict]) -> str:
    """``PHLOEM_GEMV_SHAPE_CONFIG``'s value for the fastest staged configuration of each fused
    projection's shape (the gated-norm out projection's for the 2048 x 4096 shape both out
    projections share), for an A/B of the decode step against the register walk."""
    entries = []
    for name, variant in (("in_proj", "add_rms_norm_conv_linear"), ("qkv_proj", "add_rms_norm_linear"),
                          ("out_proj", "gated_rms_norm_linear"), ("router", "add_rms_norm_router")):  # fmt: skip
        staged = [r for r in fused if r["shape"] == name and r["variant"] == f"{variant} (staged)"]
        if staged:
            c = min(staged, key=lambda r: r["us"])["config"]
            n, k = SHAPES[name]
            entries.append(f"{n}x{k}=" + ",".join(str(int(v)) for v in c))
    return "/".join(entries)


if __name__ == "__main__":
    main()
