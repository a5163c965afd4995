"""What each launch of a batch-1 decode step costs inside the step, under programmatic dependent
launch, from the timeline ``bench decode --out`` saves (``kernels.timeline``: the first replayed
step's launches in order).

    python3 benchmarks/sweeps/step_roles.py RUN.json [RUN2.json ...]

Under PDL a kernel's interval starts while the kernel before still runs (its programs wait in
``gdc_wait``), so interval lengths overlap and add up to more than the step. Each launch waits for
the one before to end, so the ends are in launch order: a launch's cost in the step is its end minus
the previous launch's end. Launches are named by their role in the 35B-A3B layer pattern (a GDN
layer: in_proj + conv, the GDN step, out_proj, the MoE router, gate/up, down; an attention layer:
qkv, the split-KV attention, its merge, o_proj, then the same MoE; with the router folded into the
projection before it, ``kernels/moe/route_partial.py``, no router launch and the roles ``out_proj_route``
and ``o_proj_route``, which read the router's bytes too); ``tail`` is the final norm,
the LM head and the argmax. Prints µs per step for each role, and with one run the bytes each role
must read and the rate that gives against the run's copy bandwidth.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

GDN_LAYER = ("in_proj", "gdn_step", "out_proj", "router", "gate_up", "down")
ATTN_LAYER = ("qkv_proj", "attn_split", "attn_merge", "o_proj", "router", "gate_up", "down")
GDN_LAYER_ROUTED = ("in_proj", "gdn_step", "out_proj_route", "gate_up", "down")
ATTN_LAYER_ROUTED = ("qkv_proj", "attn_split", "attn_merge", "o_proj_route", "gate_up", "down")
# Bytes a step reads per launch of each role at the 35B-A3B shape, 1K context, bf16 (fp32 GDN state).
H, MB = 2048, 1e6
BYTES = {
    "in_proj": 12352 * H * 2, "gdn_step": 2 * 32 * 128 * 128 * 4, "out_proj": H * 4096 * 2, "router": 257 * H * 2,
    "gate_up": 9 * 1024 * H * 2, "down": 9 * H * 512 * 2, "qkv_proj": 9216 * H * 2, "attn_split": 1024 * 2 * 2 * 256 * 2,
    "attn_merge": 0, "o_proj": H * 4096 * 2, "tail": 248320 * H * 2,
}  # fmt: skip
BYTES["out_proj_route"] = BYTES["out_proj"] + BYTES["router"]
BYTES["o_proj_route"] = BYTES["o_proj"] + BYTES["router"]


def roles(run: dict) -> dict[str, list[float]]:
    """Role -> the step costs (µs) of its launches, from ``run``'s timeline."""
    costs, names, prev = [], [], 0.0
    for name, start, dur in run["kernels"]["timeline"]:
        costs.append(start + dur - prev)
        names.append(name)
        prev = start + dur
    out: dict[str, list[float]] = defaultdict(list)
    out["embedding"].append(costs[0])
    i = 1
    while i + 1 < len(names) and names[i].startswith("gemv_kernel"):
        gdn = names[i + 1].startswith("recurrent_gated_delta_rule")
        if not gdn and not names[i + 1].startswith("decode_attention_split"):
            break  # the LM head: the tail starts
        # A router launch is a GEMV after the output projection; without it the experts follow.
        routed = not names[i + (3 if gdn else 4)].startswith("gemv_kernel")
        layer = (GDN_LAYER_ROUTED if routed else GDN_LAYER) if gdn else (ATTN_LAYER_ROUTED if routed else ATTN_LAYER)
        for k, role in enumerate(layer):
            out[role].append(costs[i + k])
        i += len(layer)
    out["tail"] = costs[i:]
    return out


def main() -> None:
    runs = [json.load(open(path)) for path in sys.argv[1:]]
    tables = [roles(r) for r in runs]
    order = ["embedding", *dict.fromkeys(GDN_LAYER + ATTN_LAYER + GDN_LAYER_ROUTED + ATTN_LAYER_ROUTED), "tail"]
    if len(runs) == 1:
        bw = runs[0]["bandwidth"]
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s\n")
        print("| role | launches | µs a step | µs a launch | MB a launch | TB/s | floor µs a step | over |")
        print("|---|---|---|---|---|---|---|---|")
        for role in order:
            v = tables[0].get(role, [])
            if not v:
                continue
            b = BYTES.get(role, 0) * len(v) if role != "tail" else BYTES["tail"]
            tb = f"{b / sum(v) / 1e6:.2f}" if b and v else "—"
            floor = b / bw * 1e6
            print(f"| {role} | {len(v)} | {sum(v):.1f} | {sum(v) / max(len(v), 1):.2f} | "
                  f"{BYTES.get(role, 0) / MB:.1f} | {tb} | {floor:.1f} | {sum(v) - floor:.1f} |")  # fmt: skip
        print(f"| total | | {sum(sum(v) for v in tables[0].values()):.1f} | | | | | |")
        return
    print("| role | " + " | ".join(p.rsplit("/", 1)[-1] for p in sys.argv[1:]) + " |")
    print("|---|" + "---|" * len(runs))
    for role in order:
        print(f"| {role} | " + " | ".join(f"{sum(t.get(role, [])):.1f}" for t in tables) + " |")
    print("| total | " + " | ".join(f"{sum(sum(v) for v in t.values()):.1f}" for t in tables) + " |")


if __name__ == "__main__":
    main()
