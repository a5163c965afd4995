"""Where the host's time goes in batch-1 decode steps (cProfile over ``engine.step``), on the GPU.

    python3 benchmarks/sweeps/host_profile.py [--steps 60] [--top 30]

Builds the 35B-A3B shape with dummy weights (one sequence, so one CUDA-graph bucket), decodes a
1K-context request with async scheduling, and prints the ms per step without and with the
profiler, then the functions with the most time of their own and the most time below them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path

from phloem.engine import Engine, SchedulerConfig
from phloem.benchmarks.decode import run_decode
from phloem.runtime.model_shapes import write_shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        engine = Engine.from_pretrained(write_shape(args.shape, Path(tmp)), load_format="dummy", device=args.device,
                                        dtype=dtype, scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=1))  # fmt: skip
    plain = run_decode(engine, 1, 1024, 1.0, steps=args.steps, compare_sync=True)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = run_decode(engine, 1, 1024, 1.0, steps=args.steps, compare_sync=False)
    profiler.disable()
    print(f"async {plain.ms_per_step:.3f} ms/step, sync {plain.sync_ms_per_step}, graph {plain.gpu_ms_per_step}; "
          f"under cProfile {profiled.ms_per_step:.3f}")  # fmt: skip
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(args.top)
        print(out.getvalue()[-6000:])


if __name__ == "__main__":
    main()
