#!/bin/bash
# Device call: `phloem serve` at the 35B-A3B shape with its defaults, the time to its first chat
# request after it reports ready, then the agentic workload at 4 and 16 agents (50K-token first
# turn, TURNS turns (default 12) of 800 new tokens, 500 generated). From the repository root:
#   bash tools/gpu/agentic.sh [AGENTS...]      (default: 4 16; writes $OUT)
# MODEL_ARGS replaces the model flags (an H100 80GB needs `... --quantization fp8`: bf16 weights
# leave it too little memory for the prefill graphs); TRIE=1 then runs the record's harness alone
# (`bench trie --trie-only`) at the last AGENTS count, 4 turns, on the same server, for
# TRIE_DURATION seconds (default 150: at 16 agents a trace takes ~80 s on an H100 with FP8 weights,
# and trie reports only the traces that finished).
source tools/gpu/setup.sh || exit 1
DATA=/tmp/phloem-data
rm -rf "$DATA"
T0=$(date +%s.%N)
MODEL_ARGS=${MODEL_ARGS:---device cuda --dtype bfloat16 --shape qwen3.5-35b-a3b}
python3 -m phloem.cli serve $MODEL_ARGS --data-dir "$DATA" --port 8000 > "$OUT/server.log" 2>&1 &
SERVER=$!
until curl -sf http://127.0.0.1:8000/health 2>/dev/null | grep -q '"ok"'; do
  kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 0.2
done
echo "ready after $(python3 -c "print(round($(date +%s.%N) - $T0, 1))") s"
python3 - <<'PY'
import time, httpx
body = {"model": httpx.get("http://127.0.0.1:8000/v1/models").json()["data"][0]["id"],
        "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
t = time.perf_counter()
r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", json=body, timeout=120)
print(f"first chat request: {r.status_code} in {time.perf_counter() - t:.3f} s")
PY
for n in ${@:-4 16}; do
  T1=$(date +%s)
  python3 -m phloem.cli bench agentic --base-url http://127.0.0.1:8000 --modes sessions --agents "$n" \
    --first-turn 50000 --append 800 --turns "${TURNS:-12}" --output 500 --no-progress --out "/tmp/agentic-$n" 2>&1 | grep -v Warning | tail -4
  cp "/tmp/agentic-$n/agentic.json" "$OUT/agentic-$n.json"
  curl -s http://127.0.0.1:8000/metrics | grep -E "^phloem_(engine|state_slots|prefix_checkpoints|kv_pages)" > "$OUT/metrics-$n.txt"
  echo "agents $n: $(( $(date +%s) - T1 )) s; $(grep -E 'failed_steps_total|memory_blocked|checkpoints_evicted_total|state_slots_used' "$OUT/metrics-$n.txt" | tr '\n' ' ')"
done
if [ "${TRIE:-0}" = 1 ]; then
  python3 -m phloem.cli bench trie --base-url http://127.0.0.1:8000 --trie-only --tokenizer "$DATA/shapes/qwen3.5-35b-a3b" \
    --agents "$n" --first-turn 50000 --append 800 --turns 4 --output 500 --duration "${TRIE_DURATION:-150}" --out "$OUT/trie" 2>&1 \
    | grep -v Warning | head -12
fi
echo "server log: $(grep -c 'for memory' "$OUT/server.log") memory waits, $(grep -cE 'ERROR|Traceback' "$OUT/server.log") errors"
grep -E "startup|warm" "$OUT/server.log" | head -12
kill $SERVER; wait $SERVER 2>/dev/null
