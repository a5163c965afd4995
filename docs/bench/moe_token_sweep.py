"""Sweep the one-token MoE kernels (``kernels/triton/moe_token.py``) on the GPU and time the whole
MoE block of a batch-1 decode layer, old composition against new, as CUDA-graph replays.

    python3 docs/bench/moe_token_sweep.py [--out moe_token.json] [--quick]

Shape: Qwen3.5-35B-A3B (256 routed experts + the shared one stored as expert 256, H=2048, I=512,
bf16, top-8 + shared). Every timing is a CUDA graph of ``LAYERS`` calls on distinct layers' weights
(nothing served from L2), replayed; TB/s counts the 9 experts' weight bytes (+ the router's for
the whole block). Every configuration is checked against the torch reference before it is timed.

    1. gate/up alone per configuration (block_n1, warps, programs per SM), ids given;
    2. down alone per configuration (block_n2, warps);
    3. the block after the attention, end to end (norm + router + routing + experts):
       ``add_rms_norm_router`` + ``fused_moe_routed`` (the sixth session's: routing inside every
       gate/up program) against ``add_rms_norm_route`` (routing in the router GEMV's last program)
       + ``fused_moe_token`` with the best few stage pairs and the shipped default.

Prints Markdown tables; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from phloem.kernels import fused_linear as ref
from phloem.kernels.moe import fused_moe as reference
from phloem.kernels.moe import moe_route_shared
from phloem.kernels.triton import fused_moe, gemv, moe_token
from phloem.runtime.bench_decode import graph_us, measure_bandwidth

E, H, I, TOP_K, LAYERS = 257, 2048, 512, 8, 8
DT = torch.bfloat16
EXPERT_BYTES = (TOP_K + 1) * 3 * H * I * 2


def make_layers(device: torch.device) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = {
            "wgu": torch.randn(E, 2 * I, H, device=device, dtype=DT, generator=gen) * H**-0.5,
            "wd": torch.randn(E, H, I, device=device, dtype=DT, generator=gen) * I**-0.5,
            "router": torch.randn(E, H, device=device, dtype=DT, generator=gen) * H**-0.5,
            "x": torch.randn(1, H, device=device, dtype=DT, generator=gen),
            "res": torch.randn(1, H, device=device, dtype=DT, generator=gen),
        }
        layer["nw"] = torch.randn(H, device=device, dtype=DT, generator=gen) * 0.1
        layer["w"], layer["ids"] = moe_route_shared(torch.randn(1, E, device=device, generator=gen).to(DT), TOP_K, True)
        layer["act"] = torch.empty(TOP_K + 1, I, device=device, dtype=DT)
        layer["out"] = torch.empty_like(layer["x"])
        layers.append(layer)
    return layers


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(got: torch.Tensor, want: torch.Tensor, what: object, tol: float = 2e-2) -> None:
    err = rel_err(got, want)
    assert err < tol, (what, err)


def _row(part: str, variant: str, config: object, us: float, nbytes: int) -> dict:
    return {"part": part, "variant": variant, "config": config, "us": us, "tb_s": nbytes / us / 1e6}


def stage_grids(quick: bool) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    if quick:
        d = moe_token.DEFAULT_CONFIG
        return [(d.block_n1, d.num_warps1, d.programs_per_sm1)], [(d.block_n2, d.num_warps2)]
    g1 = list(itertools.product((1, 2, 4), (4, 8), (2, 4, 0)))
    g2 = list(itertools.product((2, 4, 8), (2, 4, 8)))
    return g1, g2


def sweep_stages(layers: list[dict], quick: bool) -> list[dict]:
    g1, g2 = stage_grids(quick)
    base = moe_token.DEFAULT_CONFIG
    l0 = layers[0]
    want = reference(l0["x"].float(), l0["wgu"].float(), l0["wd"].float(), l0["w"].float(), l0["ids"])
    rows = []
    gate_up_bytes, down_bytes = EXPERT_BYTES * 2 // 3, EXPERT_BYTES // 3
    for bn, warps, pps in g1:
        c = base._replace(block_n1=bn, num_warps1=warps, programs_per_sm1=pps)
        check(moe_token.fused_moe_token(l0["x"], l0["wgu"], l0["wd"], l0["w"], l0["ids"], c), want, c)
        us = graph_us(lambda: [moe_token.launch_gate_up(ly["x"], ly["wgu"], ly["ids"], ly["act"], c) for ly in layers], LAYERS)  # noqa: B023
        rows.append(_row("gate_up", "moe_token", (bn, warps, pps), us, gate_up_bytes))
    for bn, warps in g2:
        c = base._replace(block_n2=bn, num_warps2=warps)
        check(moe_token.fused_moe_token(l0["x"], l0["wgu"], l0["wd"], l0["w"], l0["ids"], c), want, c)
        us = graph_us(lambda: [moe_token.launch_down(ly["act"], ly["wd"], ly["ids"], ly["w"], ly["out"], c) for ly in layers], LAYERS)  # noqa: B023
        rows.append(_row("down", "moe_token", (bn, warps), us, down_bytes))
    # The sixth session's kernels at the same ids, for the same two parts.
    old = fused_moe.DEFAULT_CONFIG
    us = graph_us(lambda: [fused_moe.launch_gate_up(ly["x"], ly["wgu"], ly["ids"], ly["act"], old) for ly in layers], LAYERS)
    rows.append(_row("gate_up", "fused_moe (ids given)", tuple(old[:4]), us, gate_up_bytes))
    us = graph_us(lambda: [fused_moe.launch_down_sum(ly["act"], ly["wd"], ly["ids"], ly["w"], ly["out"], old) for ly in layers], LAYERS)
    rows.append(_row("down", "fused_moe", tuple(old[4:]), us, down_bytes))
    return rows


def _best(rows: list[dict], part: str, n: int) -> list[tuple]:
    mine = sorted((r for r in rows if r["part"] == part and r["variant"] == "moe_token"), key=lambda r: r["us"])
    return [tuple(r["config"]) for r in mine[:n]]


def time_blocks(layers: list[dict], stage_rows: list[dict]) -> list[dict]:
    """Norm + router + routing + experts of one token, old against new."""
    nbytes = EXPERT_BYTES + E * H * 2
    l0 = layers[0]

    def old_block(ly: dict) -> torch.Tensor:
        logits, normed, _ = gemv.add_rms_norm_router(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"])
        return fused_moe.fused_moe_routed(normed, logits, ly["wgu"], ly["wd"], TOP_K, True)

    def new_block(ly: dict, c: moe_token.MoeTokenConfig) -> torch.Tensor:
        w, ids, normed, _ = gemv.add_rms_norm_route(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"], TOP_K, True)
        return moe_token.fused_moe_token(normed, ly["wgu"], ly["wd"], w, ids, c)

    w_ref, ids_ref, normed_ref, _ = ref.add_rms_norm_route(l0["x"], l0["res"], l0["nw"], 1e-6, l0["router"], TOP_K, True)
    want = reference(normed_ref.float(), l0["wgu"].float(), l0["wd"].float(), w_ref.float(), ids_ref)
    check(old_block(l0), want, "old block")
    rows = [_row("block", "router + fused_moe_routed", None, graph_us(lambda: [old_block(ly) for ly in layers], LAYERS), nbytes)]
    pairs = {moe_token.DEFAULT_CONFIG}
    for g1, g2 in itertools.product(_best(stage_rows, "gate_up", 3), _best(stage_rows, "down", 2)):
        pairs.add(moe_token.MoeTokenConfig(*g1, *g2))
    for c in sorted(pairs):
        check(new_block(l0, c), want, c)
        us = graph_us(lambda: [new_block(ly, c) for ly in layers], LAYERS)  # noqa: B023
        rows.append(_row("block", "route GEMV + fused_moe_token" + (" (default)" if c == moe_token.DEFAULT_CONFIG else ""),
                         tuple(c), us, nbytes))  # fmt: skip
    # The routing epilogue's own cost: the router GEMV with and without it.
    us = graph_us(lambda: [gemv.add_rms_norm_router(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"]) for ly in layers], LAYERS)
    rows.append(_row("router", "add_rms_norm_router", None, us, E * H * 2))
    us = graph_us(lambda: [gemv.add_rms_norm_route(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"], TOP_K, True) for ly in layers], LAYERS)
    rows.append(_row("router", "add_rms_norm_route", None, us, E * H * 2))
    return rows


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", "", "| part | variant | config | µs | TB/s |", "|---|---|---|---|---|"]
    for part in ("gate_up", "down"):
        mine = sorted((r for r in rows if r["part"] == part), key=lambda r: r["us"])
        lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |" for r in mine[:4]]
        lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |"
                  for r in mine[4:] if r["variant"] != "moe_token"]  # fmt: skip
    lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |"
              for r in rows if r["part"] in ("block", "router")]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    layers = make_layers(device)
    rows = sweep_stages(layers, args.quick)
    rows += time_blocks(layers, rows)
    print(table(rows, bandwidth))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
