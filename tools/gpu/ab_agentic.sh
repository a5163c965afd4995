#!/bin/bash
# Device call: an A/B of the served agentic workload in one call, the tree against the same tree
# with a patch reversed (the device copy has no git history), each on a fresh server on the same
# card (tools/gpu/agentic.sh: 50K-token first turns, TURNS turns of 800 + 500). From the repository
# root, with the patch an untracked file that git does not ignore (so it travels):
#   git diff BASE -- engine runtime api > ab.patch
#   PATCH=ab.patch TURNS=6 bash tools/gpu/ab_agentic.sh [AGENTS]     (default 16; writes $OUT)
# MODEL_ARGS as for agentic.sh (the default on an H100 80GB: FP8 weights, which bf16 needs an
# H200 for). The patched tree runs first (a fresh machine compiles FlashInfer's kernels on its
# server's start; pack_caches keeps them), then BASE; DEADLINE (epoch seconds) cuts the runs, then
# the GPU concurrency tests run in what is left. Prints per-agent decode, TTFT and the queued mixed
# steps of each side, then per-turn decode and TTFT from both server logs (tools/gpu/turn_rates.py), last.
source tools/gpu/setup.sh || exit 1
START=$(date +%s)
DEADLINE=${DEADLINE:-$((START + 570))}
REPO=$PWD
AGENTS=${1:-16}
[ -f "${PATCH:-}" ] || { echo "PATCH=FILE: the patch to reverse for the base side"; exit 1; }
if [ -z "${MODEL_ARGS:-}" ]; then
  MODEL_ARGS="--device cuda --dtype bfloat16 --shape qwen3.5-35b-a3b"
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || MODEL_ARGS="$MODEL_ARGS --quantization fp8"
fi
export MODEL_ARGS TURNS=${TURNS:-6}
echo "MODEL_ARGS=$MODEL_ARGS TURNS=$TURNS"
rm -rf /tmp/ab-base && mkdir -p /tmp/ab-base "$OUT/ab"
cp -r $(ls -A | grep -vE '^(\.whl|\.whl-client|\.git)$') /tmp/ab-base/ && ln -s "$REPO/.whl" /tmp/ab-base/.whl
(cd /tmp/ab-base && patch -s -R -p1 < "$REPO/$PATCH") || { echo "the patch does not reverse"; exit 1; }
for side in patched base; do
  T=$(date +%s)
  dir=$REPO; [ $side = base ] && dir=/tmp/ab-base
  mkdir -p "/tmp/ab-$side-out"
  (cd "$dir" && OUT="/tmp/ab-$side-out" timeout $((DEADLINE - T)) bash tools/gpu/agentic.sh "$AGENTS") \
    > "/tmp/ab-$side-out/run.log" 2>&1
  pkill -f "phloem.cli serve"; sleep 2
  echo "== $side: $(( $(date +%s) - T )) s"; grep -v "^WARNING" "/tmp/ab-$side-out/run.log"
  cp "/tmp/ab-$side-out/agentic-$AGENTS.json" "$OUT/ab/$side.json" 2>/dev/null
  gzip -c "/tmp/ab-$side-out/server.log" > "$OUT/ab/server-$side.log.gz"
  [ $side = patched ] && pack_caches "$OUT/ab" >/dev/null 2>&1
  cd "$REPO"
done
LEFT=$((DEADLINE + 15 - $(date +%s)))
if [ $LEFT -gt 90 ]; then
  timeout $LEFT python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/test_gpu_concurrency.py \
    -k "async_scheduling or sixteen" 2>&1 | tail -3
fi
python3 - "$OUT/ab" <<'PY'
import json, sys
from pathlib import Path
print("| side | per-agent decode tok/s (turns 2+) | TTFT turns 2+ p50 / p99 s | output tok/s | mixed steps queued / all |")
print("|---|---|---|---|---|")
for side in ("patched", "base"):
    path = Path(sys.argv[1]) / f"{side}.json"
    if not path.exists():
        print(f"| {side} | missing | | | |")
        continue
    s = json.loads(path.read_text())["summary"]["sessions"]
    e = s.get("fleet", {}).get("engine", {})
    print(f"| {side} | {s['per_user_decode_tok_s_turns_2plus']:.1f} | {s['ttft_turns_2plus_s']:.3f} / "
          f"{s['ttft_turns_2plus_p99_s']:.3f} | {s['output_tok_s']:.1f} | "
          f"{e.get('mixed_steps_queued', 0):.0f} / {e.get('mixed_steps', 0):.0f} |")
PY
# Per turn from the server logs: compares the two sides over the turns both finished when the
# deadline cut one short.
python3 tools/gpu/turn_rates.py "$OUT/ab/server-patched.log.gz" "$OUT/ab/server-base.log.gz"
