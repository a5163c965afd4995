"""Sweep the one-token MoE kernels (``kernels/moe/triton_token.py``) on the GPU and time the whole
MoE block of a batch-1 decode layer, old composition against new, as CUDA-graph replays.

    python3 benchmarks/sweeps/moe_token_sweep.py [--out moe_token.json] [--quick]

Shape: Qwen3.5-35B-A3B (256 routed experts + the shared one stored as expert 256, H=2048, I=512,
bf16, top-8 + shared). Every timing is a CUDA graph of ``LAYERS`` calls on distinct layers' weights
(nothing served from L2), replayed; TB/s counts the 9 experts' weight bytes (+ the router's for
the whole block). Every configuration is checked against the torch reference before it is timed.

    1. ``moe_token``'s gate/up per configuration (block_n, warps, programs per SM), ids given,
       against the routed-experts composition (``fused_moe._gate_up_kernel``), and the down + sum stage;
    2. the block after the attention, end to end (norm + router + routing + experts):
       ``add_rms_norm_router`` + the routed-experts kernels (1152 gate/up programs, each
       routing its own slot) against ``fused_moe_token_routed`` with the best few gate/up
       configurations and the shipped default; the fastest is printed as a ``MoeTokenConfig``,
       the value to ship as ``moe_token.DEFAULT_CONFIG``.

Prints Markdown tables; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from phloem.kernels.linear import triton_gemv as gemv
from phloem.kernels.moe import triton_decode as fused_moe
from phloem.kernels.moe import triton_token as moe_token
from phloem.kernels.moe.reference import fused_moe as reference
from phloem.kernels.moe.reference import fused_moe_routed as reference_routed
from phloem.kernels.moe.reference import moe_route_shared
from phloem.benchmarks.decode import graph_us, measure_bandwidth

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


def check(got: torch.Tensor, want: torch.Tensor, what: object, tol: float = 2e-2, strict: bool = True) -> None:
    """``strict=False``: a warning, not a failure (a routed block against the reference, where two
    bf16 logits tied at the top-k boundary may pick another expert)."""
    err = rel_err(got, want)
    if err >= tol and not strict:
        print(f"warning: {what}: relative error {err:.3g}", flush=True)
        return
    assert err < tol, (what, err)


def _row(part: str, variant: str, config: object, us: float, nbytes: int) -> dict:
    return {"part": part, "variant": variant, "config": config, "us": us, "tb_s": nbytes / us / 1e6}


def gate_up_grid(quick: bool) -> list[tuple[int, int, int]]:
    if quick:
        return [tuple(moe_token.DEFAULT_CONFIG)]
    return list(itertools.product((2, 4), (4, 8), (2, 4, 8)))


def sweep_gate_up(layers: list[dict], quick: bool) -> list[dict]:
    """``moe_token``'s gate/up per configuration with the ids given, and the routed-experts composition's."""
    l0 = layers[0]
    want = reference(l0["x"].float(), l0["wgu"].float(), l0["wd"].float(), l0["w"].float(), l0["ids"])
    rows = []
    nbytes = EXPERT_BYTES * 2 // 3
    for g in gate_up_grid(quick):
        c = moe_token.MoeTokenConfig(*g)
        check(fused_moe.fused_moe_token(l0["x"], l0["wgu"], l0["wd"], l0["w"], l0["ids"], c), want, c)
        us = graph_us(lambda: [moe_token.launch_gate_up(ly["x"], ly["wgu"], ly["ids"], ly["act"], c) for ly in layers], LAYERS)  # noqa: B023
        rows.append(_row("gate_up", "moe_token", g, us, nbytes))
    old = fused_moe.DEFAULT_CONFIG
    us = graph_us(lambda: [fused_moe.launch_gate_up(ly["x"], ly["wgu"], ly["ids"], ly["act"], old) for ly in layers], LAYERS)
    rows.append(_row("gate_up", "fused_moe (ids given)", tuple(old[:4]), us, nbytes))
    us = graph_us(lambda: [fused_moe.launch_down_sum(ly["act"], ly["wd"], ly["ids"], ly["w"], ly["out"], old) for ly in layers], LAYERS)
    rows.append(_row("down", "fused_moe", tuple(old[4:]), us, EXPERT_BYTES // 3))
    return rows


def _best(rows: list[dict], n: int) -> list[tuple]:
    mine = sorted((r for r in rows if r["part"] == "gate_up" and r["variant"] == "moe_token"), key=lambda r: r["us"])
    return [tuple(r["config"]) for r in mine[:n]]


def time_blocks(layers: list[dict], gate_up_rows: list[dict]) -> tuple[list[dict], moe_token.MoeTokenConfig]:
    """Norm + router + routing + experts of one token: the routed-experts kernels (1152
    gate/up programs, each routing its slot) against ``fused_moe_token_routed``. Returns the rows
    and the fastest configuration."""
    nbytes = EXPERT_BYTES + E * H * 2
    l0 = layers[0]
    old = fused_moe.DEFAULT_CONFIG

    def old_block(ly: dict) -> torch.Tensor:
        logits, normed, _ = gemv.add_rms_norm_router(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"])
        ids = torch.empty((1, TOP_K + 1), dtype=torch.int64, device=normed.device)
        tw = torch.empty((1, TOP_K + 1), dtype=logits.dtype, device=normed.device)
        act = torch.empty((TOP_K + 1, I), dtype=normed.dtype, device=normed.device)
        out = torch.empty_like(normed)
        fused_moe.launch_gate_up(normed, ly["wgu"], ids, act, old, (logits, tw, True))
        fused_moe.launch_down_sum(act, ly["wd"], ids, tw, out, old)
        return out

    def new_block(ly: dict, c: moe_token.MoeTokenConfig) -> torch.Tensor:
        logits, normed, _ = gemv.add_rms_norm_router(ly["x"], ly["res"], ly["nw"], 1e-6, ly["router"])
        return fused_moe.fused_moe_token_routed(normed, logits, ly["wgu"], ly["wd"], TOP_K, True, c)

    logits, normed, _ = gemv.add_rms_norm_router(l0["x"], l0["res"], l0["nw"], 1e-6, l0["router"])
    want = reference_routed(normed.float(), logits.float(), l0["wgu"].float(), l0["wd"].float(), TOP_K, True)
    check(old_block(l0), want, "old block", strict=False)
    rows = [_row("block", "router + fused_moe routed (routed)", None, graph_us(lambda: [old_block(ly) for ly in layers], LAYERS), nbytes)]
    best = (float("inf"), moe_token.DEFAULT_CONFIG)
    for c in sorted({moe_token.DEFAULT_CONFIG, *(moe_token.MoeTokenConfig(*g) for g in _best(gate_up_rows, 3))}):
        check(new_block(l0, c), want, c, strict=False)
        us = graph_us(lambda: [new_block(ly, c) for ly in layers], LAYERS)  # noqa: B023
        best = min(best, (us, c))
        rows.append(_row("block", "router + fused_moe_token_routed" + (" (default)" if c == moe_token.DEFAULT_CONFIG else ""),
                         tuple(c), us, nbytes))  # fmt: skip
    return rows, best[1]


def table(rows: list[dict], bandwidth: float) -> str:
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", "", "| part | variant | config | µs | TB/s |", "|---|---|---|---|---|"]
    for part in ("gate_up", "down"):
        mine = sorted((r for r in rows if r["part"] == part), key=lambda r: r["us"])
        lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |" for r in mine[:4]]
        lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |"
                  for r in mine[4:] if r["variant"] != "moe_token"]  # fmt: skip
    lines += [f"| {r['part']} | {r['variant']} | {r['config']} | {r['us']:.1f} | {r['tb_s']:.2f} |"
              for r in rows if r["part"] == "block"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    layers = make_layers(device)
    rows = sweep_gate_up(layers, args.quick)
    blocks, best = time_blocks(layers, rows)
    rows += blocks
    print(table(rows, bandwidth))
    print(f"best {best!r}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
