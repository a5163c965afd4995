"""Time the shared-memory GEMV prototype (``kernels/triton/gemv_dot.py``) against the register GEMV
the decode step runs (``gemv.linear`` with ``gemv_config``'s tiles) and cuBLAS, on the GPU, alone:
CUDA-graph replays over distinct weights (nothing served from L2), as ``gemv_sweep.py``.

    python3 docs/bench/gemv_dot_sweep.py [--out dot.json] [--quick]

Shapes: the 35B-A3B decode projections (bf16). Every configuration is checked against an fp32
reference before it is timed. Prints a Markdown table (µs a call, TB/s of weight bytes, fraction of
the copy bandwidth measured first); ``--out`` writes the rows as JSON. Under ``PHLOEM_PDL=1`` the
register GEMV overlaps consecutive calls of a graph and the prototype (no PDL) does not: run it
both ways (``PHLOEM_PDL=0 ...``) to compare like with like.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gemv_sweep import DT, SHAPES, check, weights  # noqa: E402

from phloem.kernels.triton import gemv  # noqa: E402
from phloem.kernels.triton.gemv_dot import DotConfig, linear_dot  # noqa: E402
from phloem.runtime.bench_decode import graph_us, measure_bandwidth  # noqa: E402


def configs(quick: bool) -> list[DotConfig]:
    if quick:
        return [DotConfig(32, 128, 4, 4), DotConfig(64, 64, 4, 4)]
    grid = itertools.product((16, 32, 64), (64, 128, 256), (3, 4), (4, 8))
    # Shared memory a program: stages x (BLOCK_N + 16) x BLOCK_K x 2 bytes; keep two programs an SM.
    return [DotConfig(*c) for c in grid if c[2] * (c[0] + 16) * c[1] * 2 <= 96 * 1024]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    bandwidth = measure_bandwidth(torch.device("cuda"))
    rows = []
    for name, (n, k) in SHAPES.items():
        ws = weights(name)
        x = torch.randn(1, k, device="cuda", dtype=DT)
        nbytes = n * k * 2
        want = F.linear(x.float(), ws[0].float())
        timed = [("cuBLAS", None, lambda w: F.linear(x, w)), ("register GEMV", gemv.gemv_config(n, k), lambda w: gemv.linear(x, w))]
        timed += [("dot", c, lambda w, c=c: linear_dot(x, w, c)) for c in configs(args.quick)]
        for variant, c, call in timed:
            check(call(ws[0]), want, (name, variant, c))
            us = graph_us(lambda call=call: [call(w) for w in ws], len(ws))
            rows.append({"shape": name, "variant": variant, "config": list(c) if c else None, "us": us,
                         "tb_s": nbytes / us / 1e6, "fraction": nbytes / us / 1e-6 / bandwidth})  # fmt: skip
        best = min((r for r in rows if r["shape"] == name and r["variant"] == "dot"), key=lambda r: r["us"])
        base = next(r for r in rows if r["shape"] == name and r["variant"] == "register GEMV")
        print(f"{name}: register GEMV {base['us']:.2f} us, best dot {best['config']} {best['us']:.2f} us", flush=True)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.3f} TB/s\n")
    print("| shape | variant | config (block_n, block_k, stages, warps) | µs | TB/s | of copy bw |")
    print("|---|---|---|---|---|---|")
    for name in SHAPES:
        mine = [r for r in rows if r["shape"] == name]
        top = sorted((r for r in mine if r["variant"] == "dot"), key=lambda r: r["us"])[:3]
        for r in [r for r in mine if r["variant"] != "dot"] + top:
            print(f"| {name} | {r['variant']} | {r['config']} | {r['us']:.2f} | {r['tb_s']:.2f} | {r['fraction']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
