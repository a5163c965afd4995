#!/bin/bash
# Device call (issue 53, items 1 and 3): resuming a spilled session at the 35B-A3B shape on one GPU.
#   bash tools/gpu/resume_checks.sh [FLEET_AGENTS]     (from the repository root; writes $OUT)
# 1. benchmarks/resume.py at 50K tokens: a session's next turn resumed from host and from disk
#    against the same turn cached and recomputed (host and disk must give the cached tokens);
# 2. benchmarks/sweeps/import_overlap.py: 16 requests decode while a 50K-token state is imported
#    every few steps, by the former drain-and-copy order and by the side-stream copy;
# 3. with the time left (DEADLINE), the oversubscribed fleet's sessions mode (tools/gpu/fleet.sh).
source tools/gpu/setup.sh || exit 1
DEADLINE=${DEADLINE:-$(( $(date +%s) + 560 ))}
T0=$(date +%s)
timeout 240 python3 - > "$OUT/resume_50k.txt" 2>&1 <<'PY'
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
timeout 200 python3 benchmarks/sweeps/import_overlap.py --context 50000 --batch 16 > "$OUT/import_overlap.txt" 2>&1
echo "import_overlap: rc $?, $(( $(date +%s) - T0 )) s"; tail -5 "$OUT/import_overlap.txt"
SETUP=0 DEADLINE=$DEADLINE bash tools/gpu/fleet.sh "${1:-128}" sessions
