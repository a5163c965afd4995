#!/bin/bash
# Device call (issue 53): an oversubscribed agent fleet at the 35B-A3B shape on one GPU, in three
# modes, each on a fresh server: sessions (tiers on: idle sessions spill to host, then disk, and
# resume), tiersoff (--no-session-tiers: evicted and recomputed) and stateless (/v1/completions
# resending the history). From the repository root:
#   bash tools/gpu/fleet.sh [AGENTS] [MODES]      (default: 128 sessions,tiersoff,stateless; writes $OUT)
#
# Scaled so the three modes fit one 10-minute call (each mode, server start included, under
# `timeout $MODE_TIMEOUT`): an 8K first turn (the issue asks 20K-50K), 6 turns of 800 new tokens and
# 128 generated (the issue: 12 x 500), tool waits lognormal with a 2 s median and sigma 1.5, capped
# at 60 s (p90 14 s, p99 60 s). The fleet grows to ~12.8K tokens an agent (~1.6M at 128 agents,
# ~34 GB of KV + GDN state at ~21 KB a token); the KV pool is capped at 40,000 pages (640K tokens,
# ~40% of it), the host tier at 16 GiB (~60 agents' state), the rest spills to disk. BACKLOG=BYTES
# sets the host backlog (spilled state waiting for the disk writes that make its room; default: the
# server's, a quarter of HOST_BYTES: a burst of spills past it drops segments, recomputed later). Sessions stay pinned
# 1 s after a turn, then spill to host as the pin ends (--idle-to-host 0: copied before they are
# unpinned, so eviction never takes a state with no copy), so the agents waiting on a tool leave the GPU. At 64
# agents the same pool holds ~80% of the fleet: POOL=20000 keeps the pressure. PREFETCH=S has each
# agent send the SDK's prefetch hint S seconds before its tool wait ends (default 0: the append
# itself triggers the resume). DURATION=S stops each mode's agents S seconds in (no turn starts
# later; the report counts the turns not started), so a mode ends inside its call with a report;
# DRAIN=S then cancels the turns still running S seconds after it (default: what MODE_TIMEOUT
# leaves after DURATION and 100 s for the server's start and the report; they count as not started).
# Every size is an environment variable (below); SETUP=0 and
# MODEL_ARGS="--device cpu" with small sizes run the script on a CPU (a smoke test of it).
# WARM=1 first starts one server with the fleet's flags and sends it a chat request, so FlashInfer
# and Triton build their kernels outside every mode's timeout, then packs the caches into
# $OUT/*.tgz (copy them into .gpu-cache/ and carry it: a later machine skips the builds).
[ "${SETUP:-1}" = 0 ] || source tools/gpu/setup.sh || exit 1
AGENTS=${1:-128}
MODES=${2:-sessions,tiersoff,stateless}
OUT=${OUT:-/tmp/fleet-out}; mkdir -p "$OUT"
MODEL_ARGS=${MODEL_ARGS:---device cuda --dtype bfloat16 --shape qwen3.5-35b-a3b}
POOL=${POOL:-40000} FIRST=${FIRST:-8000} APPEND=${APPEND:-800} TURNS=${TURNS:-6} OUTPUT=${OUTPUT:-128}
WAIT=${WAIT:-lognormal:2:1.5:60} PREFETCH=${PREFETCH:-0} HOST_BYTES=${HOST_BYTES:-$((16 << 30))}
MODE_TIMEOUT=${MODE_TIMEOUT:-170} DURATION=${DURATION:-0}
ARGS=()
for a in $MODEL_ARGS --num-pages "$POOL" --default-ttl 1 --idle-to-host 0 --host-budget-bytes "$HOST_BYTES" \
         ${BACKLOG:+--host-backlog-bytes "$BACKLOG"}; do
  ARGS+=("--server-arg=$a")
done
if [ "${WARM:-0}" = 1 ]; then
  T1=$(date +%s)
  python3 -m phloem.cli serve $MODEL_ARGS --num-pages "$POOL" --port 8090 --data-dir /tmp/fleet-warm \
    > "$OUT/warm_server.log" 2>&1 &
  WARM_PID=$!
  until curl -sf http://127.0.0.1:8090/health 2>/dev/null | grep -q '"ok"'; do
    kill -0 $WARM_PID 2>/dev/null || { echo "warm-up server died"; tail -20 "$OUT/warm_server.log"; exit 1; }
    sleep 1
  done
  MODEL=$(curl -s http://127.0.0.1:8090/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
  curl -s http://127.0.0.1:8090/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"warm up\"}],\"max_tokens\":8}" >/dev/null
  kill -INT $WARM_PID; wait $WARM_PID 2>/dev/null
  declare -F pack_caches >/dev/null && pack_caches "$OUT" >/dev/null
  echo "warm-up: $(( $(date +%s) - T1 )) s"
fi
for mode in ${MODES//,/ }; do
  T1=$(date +%s)
  # DEADLINE (epoch seconds): no mode runs past it (a call's own limit would lose its report).
  [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - T1 )) -lt "$MODE_TIMEOUT" ] && MODE_TIMEOUT=$(( DEADLINE - T1 ))
  [ "$MODE_TIMEOUT" -gt 30 ] || { echo "$mode: no time left before DEADLINE"; continue; }
  DRAIN_S=${DRAIN:-0}
  if [ -z "${DRAIN:-}" ] && [ "${DURATION%.*}" -gt 0 ]; then
    DRAIN_S=$(( MODE_TIMEOUT - ${DURATION%.*} - 100 )); [ "$DRAIN_S" -ge 10 ] || DRAIN_S=10
  fi
  # SIGINT first: the bench stops its server in a finally (SIGTERM would orphan it on the GPU).
  timeout -s INT -k 30 "$MODE_TIMEOUT" python3 -m phloem.cli bench agentic --modes "$mode" --agents "$AGENTS" \
    --first-turn "$FIRST" --append "$APPEND" --turns "$TURNS" --output "$OUTPUT" --tool-wait "$WAIT" \
    --prefetch-ahead "$PREFETCH" --duration "$DURATION" --drain "$DRAIN_S" "${ARGS[@]}" --no-progress --out "$OUT/fleet-$AGENTS-$mode" 2>&1 \
    | tee "$OUT/fleet-$AGENTS-$mode.log" | grep -v Warning | tail -14
  echo "$mode: rc ${PIPESTATUS[0]}, $(( $(date +%s) - T1 )) s"
done
ls "$OUT"/fleet-*/
