"""What the device runs between two batch-1 decode graphs, on the GPU: the engine's own steps.

    python3 benchmarks/sweeps/step_trace.py [--steps 12] [--out trace.json]

Builds the 35B-A3B shape with dummy weights (one sequence), decodes a 1K-context request with
async scheduling under the CUDA profiler, and prints, for the steady-state steps, every device
activity outside the step's graph (copies, sampling kernels) with its duration, the gap from the
end of one step's last graph kernel (the LM head) to the start of the next step's first, and the
wall ms per step. The decode bench's ``ms/step`` minus its graph replay time is this gap.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from phloem.engine import Engine, SchedulerConfig
from phloem.benchmarks.decode import run_decode
from phloem.runtime.model_shapes import write_shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(write_shape(args.shape, Path(tmp)), load_format="dummy", device="cuda",
                                        dtype="bfloat16", scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=1))  # fmt: skip
    plain = run_decode(engine, 1, 1024, 1.0, steps=30, compare_sync=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        traced = run_decode(engine, 1, 1024, 1.0, steps=args.steps, warmup=3, compare_sync=False)
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start),
        key=lambda e: e.time_range.start,
    )
    rows = [(e.name[:60], e.time_range.start, e.time_range.end - e.time_range.start) for e in events]
    # A step's graph starts with the embedding gather and ends with the LM head (the longest kernel).
    heads = [i for i, (_, _, dur) in enumerate(rows) if dur > 150.0]
    between: dict[str, list[float]] = {}
    gaps = []
    for a, b in zip(heads, heads[1:]):
        end_a = rows[a][1] + rows[a][2]
        nxt = next((j for j in range(a + 1, b) if rows[j][0].startswith("void at::native::(anonymous namespace)::indexSel")), None)
        if nxt is None:
            continue
        gaps.append(rows[nxt][1] - end_a)
        for name, _start, dur in rows[a + 1 : nxt]:
            between.setdefault(name, []).append(dur)
    steady = gaps[2:] or gaps
    result = {
        "ms_per_step": plain.ms_per_step,
        "ms_per_step_traced": traced.ms_per_step,
        "graph_ms": plain.gpu_ms_per_step,
        "gap_us_lm_head_end_to_next_step": steady,
        "between_steps": {k: [round(x, 2) for x in v] for k, v in between.items()},
        "first_gap_rows": [(n, round(s - rows[heads[2]][1], 2), round(d, 2)) for n, s, d in rows[heads[2] : heads[2] + 40]]
        if len(heads) > 3 else [],
    }
    print(f"ms/step {plain.ms_per_step:.3f} (traced {traced.ms_per_step:.3f}), graph {plain.gpu_ms_per_step}")
    print(f"gap LM head end -> next step's first kernel, us: {[round(g, 1) for g in steady]}")
    print("| between steps (device) | calls | mean us |")
    print("|---|---|---|")
    for name, durs in between.items():
        print(f"| {name} | {len(durs)} | {sum(durs) / len(durs):.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
