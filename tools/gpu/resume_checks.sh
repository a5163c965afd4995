#!/bin/bash
# Device call (issue 53, items 1 and 3): the resume paths on one GPU, most needed first.
#   STEPS="tests resume overlap fleet" bash tools/gpu/resume_checks.sh   (repository root; writes $OUT)
# 1. the GPU token tests of the paths a resume takes: a spilled prefix imported on the side stream
#    while other requests decode (tests/engine/test_gpu_engine.py), async against sync and batched
#    against alone at 4 and 16 requests, sixteen sessions on the engine loop
#    (tests/engine/test_gpu_concurrency.py), the trained model's tokens (test_gpu_trained_model.py);
# 2. benchmarks/resume.py at 50K tokens, 35B-A3B shape: a session's next turn resumed from host and
#    from disk against the same turn cached and recomputed (host and disk must give the cached tokens);
# 3. benchmarks/sweeps/import_overlap.py: 16 requests decode while a 50K-token state is imported
#    every few steps, by the former drain-and-copy order and by the side-stream copy;
# 4. fleet: tools/gpu/fleet.sh's sessions mode with the time left ($FLEET_AGENTS, default 128;
#    DURATION = the time left less 150 s for the server's start and the last turns).
# STEPS (default "tests resume overlap") picks and orders them.
# Each step runs only while DEADLINE (epoch seconds; default 560 s from now) leaves it time; the
# kernel caches are packed into $OUT at the end (copy them into .gpu-cache/ for the fleet's calls).
# Every step also logs into $OUT (gpu_tests.log, resume_50k.txt, import_overlap.txt,
# fleet-*.log): send this script's own output to a file in $OUT too, not through a pipe, so a
# call that reaches its limit still brings back what ran.
source tools/gpu/setup.sh || exit 1
DEADLINE=${DEADLINE:-$(( $(date +%s) + 560 ))}
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
STEPS=${STEPS:-tests resume overlap}
step_tests() {
timeout -k 10 "$(cap 480)" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
  tests/engine/test_gpu_engine.py -k "resume_queued or async_scheduling or prefix_hits or concurren or sixteen or trained or logits" \
  tests/engine/test_gpu_concurrency.py tests/engine/test_gpu_trained_model.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "rc $?"; grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -8
}
step_resume() {
# RESUME_FRACTION: the pools' share of the memory the weights leave (0.85 leaves too little for
# the prefill graphs beside the 35B-A3B weights on an 80 GB card: 0.5 there).
timeout "$(cap 220)" python3 - "${RESUME_FRACTION:-0.85}" > "$OUT/resume_50k.txt" 2>&1 <<'PY'
import sys
import tempfile
from pathlib import Path
from phloem.benchmarks.resume import run_resume_bench
from phloem.engine.config import CacheConfig, EngineConfig, LoadConfig
from phloem.runtime.model_shapes import ensure_shape_model
data = Path(tempfile.mkdtemp())
options = EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16", load_format="dummy"),
                       cache=CacheConfig(memory_fraction=float(sys.argv[1])))
print(run_resume_bench(ensure_shape_model("qwen3.5-35b-a3b", data), data, prompt_len=50_000, append_len=800,
                       reps=3, options=options).table())
PY
echo "rc $?"; tail -9 "$OUT/resume_50k.txt"
}
step_overlap() {
timeout "$(cap 200)" python3 benchmarks/sweeps/import_overlap.py --context 50000 --batch 16 \
  > "$OUT/import_overlap.txt" 2>&1
echo "rc $?"; tail -5 "$OUT/import_overlap.txt"
}
step_fleet() {
SETUP=0 DEADLINE=$DEADLINE MODE_TIMEOUT=$(left) DURATION=${DURATION:-$(( $(left) - 150 ))} bash tools/gpu/fleet.sh "${FLEET_AGENTS:-128}" sessions
}
for step in $STEPS; do
  T0=$(date +%s)
  [ "$(left)" -gt 60 ] || { echo "$step: no time left before DEADLINE"; continue; }
  echo "== $step"; "step_$step"; echo "$step: $(( $(date +%s) - T0 )) s"
done
[ -n "${NO_PACK:-}" ] || pack_caches "$OUT" >/dev/null
