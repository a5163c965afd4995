"""Sweep the one-token decode GEMVs (``kernels/linear/triton_gemv.py``) on the GPU against cuBLAS, timing
CUDA-graph replays over distinct weights (nothing served from L2).

    python3 benchmarks/sweeps/gemv_sweep.py [--out gemv.json] [--quick]
    python3 benchmarks/sweeps/gemv_sweep.py --top gemv.json --out gemv_again.json

Shapes: the 35B-A3B decode projections (bf16). Pass 1 times the plain GEMV in every launch
configuration against ``F.linear`` per weight shape; pass 2 times the fused projections of
``kernels.linear.reference`` (each with the best plain configurations of its shape) against the unfused
ops the model ran before (Triton norms / conv / routing around cuBLAS). ``--top FILE`` skips the
grid and times only the best configurations FILE found. Every launch is without programmatic
dependent launch (the launchers' ``pdl=False``); the engine's choice, ``KernelConfig.pdl``, is
timed end to end by ``phloem bench decode``. Every configuration is checked against an fp32 reference
before it is timed. Prints Markdown; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp

import torch
import torch.nn.functional as F

from phloem.kernels.gdn import triton_conv1d as conv1d_update
from phloem.kernels.linear import reference as ref
from phloem.kernels.linear import triton_gemv as gemv
from phloem.kernels.moe import triton_route as moe_route
from phloem.kernels.norm import triton_norm as norm
from phloem.benchmarks.decode import graph_us, measure_bandwidth

H, CONV, VD, HQD, E, TOP_K = 2048, 8192, 4096, 4096, 256, 8
SHAPES = {  # name: (N, K)
    "in_proj": (CONV + VD + 64, H),
    "qkv_proj": (2 * HQD + 1024, H),
    "out_proj": (H, VD),
    "router": (E + 1, H),
    "lm_head": (248320, H),
}
LAYERS = {"lm_head": 2}
DT = torch.bfloat16


def configs(num_k: int, quick: bool) -> list[gemv.GemvConfig]:
    kp = 1 << (num_k - 1).bit_length()
    if quick:
        return [gemv.gemv_config(1, num_k), gemv.GemvConfig(4, 8, 1, 2, True)]
    out = [gemv.GemvConfig(bn, w, 1, 0, False) for bn, w in itertools.product((1, 2, 4, 8), (4, 8))]
    modes = ((False, 1), (False, 3), (True, 1))
    out += [gemv.GemvConfig(bn, w, st, pps, pf)
            for bn, w, pps, (pf, st) in itertools.product((2, 4, 8), (4, 8), (1, 2, 4), modes)]  # fmt: skip
    return [c for c in out if c.block_n * kp <= 16384]


def weights(name: str) -> list[torch.Tensor]:
    n, k = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(n)
    return [torch.randn(n, k, device="cuda", dtype=DT, generator=gen) * k**-0.5 for _ in range(LAYERS.get(name, 8))]


def check(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 2e-2 and not got.isnan().any(), (what, err)


def _compile(job: tuple[list[tuple[str, gemv.GemvConfig]], int]) -> int:
    """Compile plain-GEMV configs into Triton's on-disk cache (a worker process)."""
    todo, _ = job
    for name, c in todo:
        n, k = SHAPES[name]
        gemv.linear_tuned(torch.randn(1, k, device="cuda", dtype=DT), torch.randn(n, k, device="cuda", dtype=DT), c)
    torch.cuda.synchronize()
    return len(todo)


def sweep_plain(quick: bool, jobs: int) -> list[dict]:
    todo = [(name, c) for name in ("in_proj", "out_proj", "router") for c in configs(SHAPES[name][1], quick)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile, [(todo[j::jobs], j) for j in range(jobs)])
    rows = []
    for name in SHAPES:
        ws = weights(name)
        n, k = SHAPES[name]
        x = torch.randn(1, k, device="cuda", dtype=DT)
        rows.append(_row(name, "cuBLAS", None, graph_us(lambda: [F.linear(x, w) for w in ws], len(ws)), n * k * 2))
        grid = configs(k, quick) if name != "lm_head" else [r["config"] for r in _best(rows, "in_proj", 3)]
        for c in grid:
            c = gemv.GemvConfig(*c)
            check(gemv.linear_tuned(x, ws[0], c), F.linear(x.float(), ws[0].float()), (name, c))
            rows.append(_row(name, "plain", c, graph_us(lambda: [gemv.linear_tuned(x, w, c) for w in ws], len(ws)), n * k * 2))
        print(f"{name}: cuBLAS {rows[-len(grid) - 1]['us']:.1f} us, best {_best(rows, name, 1)[0]}", flush=True)
    return rows


def _row(name: str, variant: str, c: gemv.GemvConfig | None, us: float, nbytes: int) -> dict:
    return {"shape": name, "variant": variant, "config": list(c) if c else None, "us": us, "tb_s": nbytes / us / 1e6}


def _best(rows: list[dict], name: str, top: int) -> list[dict]:
    return sorted((r for r in rows if r["shape"] == name and r["variant"] == "plain"), key=lambda r: r["us"])[:top]


def fused_cases(name: str, ws: list[torch.Tensor]):
    """(variant, fused call, unfused call, fp32 reference call) for the fused ops of a shape; each
    takes the weight, the fused one its tiles from ``gemv.gemv_config``."""
    n, k = SHAPES[name]
    x, res = torch.randn(1, k, device="cuda", dtype=DT), torch.randn(1, k, device="cuda", dtype=DT)
    nw = torch.randn(k, device="cuda", dtype=DT) * 0.1
    if name == "in_proj":
        cw = torch.randn(CONV, 4, device="cuda", dtype=DT)
        states = torch.randn(4, CONV, 3, device="cuda", dtype=DT)
        slots = torch.tensor([1], device="cuda")

        def unfused(w):
            normed, r = norm.add_rms_norm(x, res, nw, 1e-6)
            y = F.linear(normed, w)
            return conv1d_update.causal_conv1d_update(y[:, :CONV], cw, None, states, slots, slots), r

        def reference(w):  # fp32, on a copy of the state the fused call is about to read
            f = [t.float().clone() for t in (x, res, nw, w, cw, states)]
            return ref.add_rms_norm_conv_linear(*f[:3], 1e-6, f[3], f[4], f[5], slots, slots)[0]

        yield ("add_rms_norm_conv_linear", lambda w: gemv.add_rms_norm_conv_linear(x, res, nw, 1e-6, w, cw, states, slots, slots)[0],
               unfused, reference)  # fmt: skip
    if name == "qkv_proj":
        yield ("add_rms_norm_linear", lambda w: gemv.add_rms_norm_linear(x, res, nw, 1e-6, w)[0],
               lambda w: F.linear(norm.add_rms_norm(x, res, nw, 1e-6)[0], w),
               lambda w: ref.add_rms_norm_linear(x.float(), res.float(), nw.float(), 1e-6, w.float())[0])  # fmt: skip
    if name == "out_proj":
        v, z = torch.randn(1, 32, 128, device="cuda", dtype=DT), torch.randn(1, 32, 128, device="cuda", dtype=DT)
        gw = 1 + torch.randn(128, device="cuda", dtype=DT) * 0.1
        yield ("gated_rms_norm_linear", lambda w: gemv.gated_rms_norm_linear(v, z, gw, 1e-6, w),
               lambda w: F.linear(norm.gated_rms_norm(v, z, gw, 1e-6).view(1, -1), w),
               lambda w: ref.gated_rms_norm_linear(v.float(), z.float(), gw.float(), 1e-6, w.float()))  # fmt: skip
        g = torch.randn(1, k, device="cuda", dtype=DT)
        yield ("sigmoid_gate_linear", lambda w: gemv.sigmoid_gate_linear(x, g, w),
               lambda w: F.linear(x * torch.sigmoid(g), w),
               lambda w: ref.sigmoid_gate_linear(x.float(), g.float(), w.float()))  # fmt: skip
    if name == "router":
        def unfused(w):
            normed, _ = norm.add_rms_norm(x, res, nw, 1e-6)
            return F.linear(normed, w)

        yield ("add_rms_norm_router", lambda w: gemv.add_rms_norm_router(x, res, nw, 1e-6, w)[0], unfused,
               lambda w: ref.add_rms_norm_router(x.float(), res.float(), nw.float(), 1e-6, w.float())[0])  # fmt: skip


def sweep_fused(plain: list[dict]) -> list[dict]:
    rows = []
    for name in ("in_proj", "qkv_proj", "out_proj", "router"):
        ws = weights(name)
        n, k = SHAPES[name]
        base = "in_proj" if name == "qkv_proj" else name
        tops = [gemv.GemvConfig(*r["config"]) for r in _best(plain, base, 3)] + [gemv.gemv_config(n, k)]
        for variant, fused, unfused, reference in fused_cases(name, ws):
            rows.append(_row(name, f"{variant} (unfused ops)", None, graph_us(lambda: [unfused(w) for w in ws], len(ws)), n * k * 2))
            for c in dict.fromkeys(tops):
                original = gemv.gemv_config
                gemv.gemv_config = lambda n_, k_, conv=False, c=c: c  # the fused ops take their tiles from here
                try:
                    want = reference(ws[0])
                    check(fused(ws[0]), want, (variant, c))
                    rows.append(_row(name, variant, c, graph_us(lambda: [fused(w) for w in ws], len(ws)), n * k * 2))
                finally:
                    gemv.gemv_config = original
    return rows


def sweep_moe() -> list[dict]:
    """The MoE block of one token after its router: the routing kernel + both expert stages against
    ``fused_moe_routed`` (the routing inside the gate/up stage), on 8 layers' experts."""
    from phloem.kernels.moe import triton_decode as fused_moe

    e, inter, layers = E + 1, 512, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats = [(torch.randn(e, 2 * inter, H, device="cuda", dtype=DT, generator=gen) * 0.02,
             torch.randn(e, H, inter, device="cuda", dtype=DT, generator=gen) * 0.02) for _ in range(layers)]  # fmt: skip
    x = torch.randn(1, H, device="cuda", dtype=DT)
    logits = torch.randn(1, e, device="cuda", dtype=DT)
    nbytes = (TOP_K + 1) * 3 * H * inter * 2

    def unfused(wgu, wd):
        w, ids = moe_route.moe_route_shared(logits, TOP_K, True)
        return fused_moe.fused_moe(x, wgu, wd, w, ids)

    want = unfused(*mats[0])
    rows = [_row("moe", "route + fused_moe (unfused ops)", None, graph_us(lambda: [unfused(*m) for m in mats], layers), nbytes)]
    check(fused_moe.fused_moe_routed(x, logits, *mats[0], TOP_K, True), want, "fused_moe_routed")
    us = graph_us(lambda: [fused_moe.fused_moe_routed(x, logits, *m, TOP_K, True) for m in mats], layers)
    rows.append(_row("moe", "fused_moe_routed", None, us, nbytes))
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", "",
             "| shape | variant | config (block_n, warps, stages, programs/SM, prefetch) | µs | TB/s |", "|---|---|---|---|---|"]
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["shape"], r["variant"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    for r in best.values():
        lines.append(f"| {r['shape']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--top", help="time only the best configurations of this earlier --out")
    ap.add_argument("--jobs", type=int, default=12)
    args = ap.parse_args()
    bandwidth = measure_bandwidth(torch.device("cuda"))
    if args.top:
        with open(args.top) as f:
            earlier = json.load(f)["rows"]
        plain = []
        for name in SHAPES:
            ws, (n, k) = weights(name), SHAPES[name]
            x = torch.randn(1, k, device="cuda", dtype=DT)
            plain.append(_row(name, "cuBLAS", None, graph_us(lambda: [F.linear(x, w) for w in ws], len(ws)), n * k * 2))
            for r in _best(earlier, name, 3):
                c = gemv.GemvConfig(*r["config"])
                plain.append(_row(name, "plain", c, graph_us(lambda: [gemv.linear_tuned(x, w, c) for w in ws], len(ws)), n * k * 2))
    else:
        plain = sweep_plain(args.quick, args.jobs)
    rows = plain + sweep_fused(plain) + sweep_moe()
    print(table(rows, bandwidth))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
