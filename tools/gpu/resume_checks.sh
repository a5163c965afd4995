#!/bin/bash
# Device call (issue 53, items 1 and 3): the resume paths on one GPU, most needed first.
#   bash tools/gpu/resume_checks.sh      (from the repository root; writes $OUT)
# 1. the GPU token tests of the paths a resume takes: a spilled prefix imported on the side stream
#    while other requests decode (tests/engine/test_gpu_engine.py), async against sync and batched
#    against alone at 4 and 16 requests, sixteen sessions on the engine loop
#    (tests/engine/test_gpu_concurrency.py), the trained model's tokens (test_gpu_trained_model.py);
# 2. benchmarks/resume.py at 50K tokens, 35B-A3B shape: a session's next turn resumed from host and
#    from disk against the same turn cached and recomputed (host and disk must give the cached tokens);
# 3. benchmarks/sweeps/import_overlap.py: 16 requests decode while a 50K-token state is imported
#    every few steps, by the former drain-and-copy order and by the side-stream copy.
# Each step runs only while DEADLINE (epoch seconds; default 560 s from now) leaves it time; the
# kernel caches are packed into $OUT at the end (copy them into .gpu-cache/ for the fleet's calls).
source tools/gpu/setup.sh || exit 1
DEADLINE=${DEADLINE:-$(( $(date +%s) + 560 ))}
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
T0=$(date +%s)
timeout "$(cap 280)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/engine/test_gpu_engine.py -k "resume_queued or async_scheduling or prefix_hits or concurren or sixteen or trained or logits" \
  tests/engine/test_gpu_concurrency.py tests/engine/test_gpu_trained_model.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests: rc $?, $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -8
T0=$(date +%s)
[ "$(left)" -gt 60 ] && timeout "$(cap 220)" python3 - > "$OUT/resume_50k.txt" 2>&1 <<'PY'
import tempfile
from pathlib import Path
from phloem.benchmarks.resume import run_resume_bench
from phloem.engine.config import EngineConfig, LoadConfig
from phloem.runtime.model_shapes import ensure_shape_model
data = Path(tempfile.mkdtemp())
options = EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16", load_format="dummy"))
print(run_resume_bench(ensure_shape_model("qwen3.5-35b-a3b", data), data, prompt_len=50_000, append_len=800,
                       reps=3, options=options).table())
PY
echo "resume: rc $?, $(( $(date +%s) - T0 )) s"; tail -9 "$OUT/resume_50k.txt"
T0=$(date +%s)
[ "$(left)" -gt 60 ] && timeout "$(cap 200)" python3 benchmarks/sweeps/import_overlap.py --context 50000 --batch 16 \
  > "$OUT/import_overlap.txt" 2>&1
echo "import_overlap: rc $?, $(( $(date +%s) - T0 )) s"; tail -5 "$OUT/import_overlap.txt"
pack_caches "$OUT" >/dev/null
