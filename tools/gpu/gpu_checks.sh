#!/bin/bash
# Every GPU acceptance check still open, in one run on a two-H200 machine; a table at the end.
#
#   bash tools/gpu/gpu_checks.sh OUT_DIR [STEPS]   # from the repository root, phloem importable
#
# STEPS (default "0 1+3a 6 5 2 3b 4 9": most needed first, for a lease that ends early) runs in
# the order given; "A+B" runs A on GPU 0 and B on GPU 1
# at the same time (a correctness step beside a single-GPU timing: they share no GPU).
# Order matters for device time: FlashInfer JIT-compiles each kernel variant on first use (minutes
# on a fresh machine; the third session's TP test sat in two ranks' ninja builds for 15 minutes),
# so step 0 compiles them once, in one process, before anything runs in parallel or under a timeout.
#   0   warm-up: the tiny model (head_dim 64) in bf16 and fp32, prefill + decode + graphs, and the
#       35B-A3B shape (head_dim 256) prefill + decode; then FlashInfer's built modules are packed
#       into OUT/flashinfer_so.tgz (a later machine can start from them)
#   1   single-GPU tests (pytest -m gpu), incl. async scheduling against sync, bitwise, and the
#       fused KV-write prologue and in-kernel GDN gates at the 35B-A3B shapes; more than one call's
#       600 s: 1a runs tests/kernels (~4 min with carried caches), 1b tests/engine
#   2   TP=2 tests (graphs on both ranks, a resume from a gathered export; the cuda:1 engine test)
#   3a  decode bench TP=1, batch 1 and 16 at 1K context (each point timed with async scheduling
#       and again without it: the "sync ms/step" column), with the defaults; again with cuBLAS
#       for one-token linear calls (PHLOEM_TRITON_GEMV=0), and without programmatic dependent
#       launch on top (PHLOEM_PDL=0)
#   3b  decode bench TP=2 (NCCL all-reduces, then the one-shot kernel), and TP=2 + expert parallelism
#   4   PD: tiny model, prefill on GPU 0 and decode on GPU 1, tokens against a colocated server
#   5   PD vs colocated on the 35B-A3B shape, agentic workload (50K first turn, 800-token turns)
#   6   the TP all-reduce: one-shot NVLink all-reduce + residual + RMSNorm against NCCL (tokens
#       and µs per call, benchmarks/sweeps/allreduce_bench.py)
#   7   the one-token decode GEMVs (benchmarks/sweeps/gemv_sweep.py): every launch configuration against
#       cuBLAS, the fused projections against the unfused ops ($GEMV_TOP=FILE: only the best
#       configurations of an earlier sweep's --out FILE)
#   8   decode bench TP=1, batch 1 and 16 at 1K, variants from $DECODE_VARIANTS: unfused (the
#       one-token path's unfused ops, PHLOEM_FUSED_DECODE=0), fused (PDL off), fused_pdl (the
#       default), cublas (PHLOEM_TRITON_GEMV=0); each with the kernel profile of the batch-1 graph
#   11  the decode bench's whole grid with the defaults: batch 1/4/16/64 at 1K/32K/128K, a 50K prefill
#   12  batch-1 decode alone at 1K/32K/128K with the defaults (the one-token path; batches > 1 are step 11's)
#   13  the one-token MoE kernels (benchmarks/sweeps/moe_token_sweep.py): stage sweeps, then the MoE block
#       (norm + router + routing + experts) of the sixth session against this one's
#   15  the split-KV Triton decode attention against FlashInfer's (benchmarks/sweeps/decode_attention_bench.py)
#   16  the GPU tests of the seventh session's kernels alone (a quick subset of step 1)
#   17  batch-1 decode at 1K: FlashInfer's decode instead of the Triton one (PHLOEM_TRITON_DECODE_ATTENTION=0)
#   20  batch-1 decode at 1K once per environment in $DECODE_ENVS ("name:VAR=v+VAR=v name2:..."; a value
#       may hold commas); $DECODE_BATCHES (e.g. 1,16) for other batch sizes, $DECODE_ARGS more arguments (--steps 100)
#   26  the GPU tests of the one-token GEMVs (the conv update's modes and the router partial's epilogue
#       included) and the expert kernels (or the test files in $GPU_TESTS)
#   21  what the device runs between two batch-1 decode graphs (benchmarks/sweeps/step_trace.py)
#   23  the GPU tests of the GDN decode, argmax and one-token MoE kernels and the engine (tokens: graphs,
#       eager, CPU)
#   24  the engine's GPU tests alone (tests/engine/test_gpu_engine.py; $TEST_TIMEOUT seconds, default 400)
#   25  the GPU tests of the tenth session's kernels: the decode attention with and without its prologue,
#       the QK-norm kernel (its row code now shared), argmax, the copy-bandwidth timers
#   30  batch-1 decode at 32K and 128K once per environment in $LONG_ENVS (step 20's summary)
#   10  where the host's time goes in batch-1 async decode steps (benchmarks/sweeps/host_profile.py, cProfile)
#   31  the served mixed step (issue 28): the GDN prefill call's host time (benchmarks/sweeps/gdn_host.py),
#       FlashInfer's FA3 / fa2 / hand-split prefill for a tool result's chunk over a long history
#       (benchmarks/sweeps/prefill_attention_bench.py), then mixed steps of 16 agents at 57K with the
#       decode rows in the prefill call and split out (benchmarks/sweeps/mixed_step.py); after step 0
#   32  the concurrency and switch token tests: random-weight logits bound, the trained model's tokens
#       at 4 and 16 requests, every kernel switch at the real shape (tests/engine/test_gpu_concurrency.py,
#       test_gpu_trained_model.py, test_gpu_switches.py); after step 0
#   40  every `gpu` test: tests/kernels and tests/engine side by side (their engines size their own
#       pools), then tests/api and tests/runtime (a `phloem serve` with its defaults takes the card);
#       a group's failures are re-run alone afterwards, so contention is told from a real failure
#       (tests/engine/test_gpu_concurrency.py takes most of the card: its OOMs beside tests/kernels are
#       contention); modules importing what the GPU image lacks (schemathesis) are skipped
#   41  decode at 1K, batch 1 and 16, with the JSON-schema and the default tool-call grammar columns
#   42  16 agents sharing an 8K system prompt (`bench agentic --shared-prefix`), chat route against
#       the session API, each a fresh server
#   43  the record's agentic workload at 16 agents, session API against the chat-style resending
#       client (/v1/completions), each a fresh server
#   44  MTP speculation on CUDA (issue 50): the trained model's greedy tokens with mtp:1/2/3 against plain,
#       256 tokens x 8 prompts at batch 1 and 8, graphs on for plain steps (tests/engine/test_gpu_mtp_speculation.py),
#       and `bench decode --speculative` on CUDA (tests/benchmarks/test_speculative_decode.py)
#   45  the speculative step's split at the 35B-A3B shape, batch 1 and 16 at 1K, mtp:1/2/3
#       (`bench decode --speculative mtp:K --accept-length 3.1`; dummy weights: the length is a projection)
#   46  FP8 (issue 51) correctness on the card: the FP8 GEMV, expert and W8A8 kernels' GPU tests at the
#       35B-A3B shapes, FP8 KV pages, and the trained model quantized at load (graphs + fused FP8
#       kernels against its eager dequantized path; logits against bf16: tests/engine/test_gpu_fp8_model.py),
#       and the pools sized from the memory the load freed (tests/engine/test_gpu_pool_sizing.py)
#   47  FP8 speed: the FP8 GEMV against bf16 and dequantize-on-read (benchmarks/sweeps/gemv_fp8_bench.py),
#       W8A8 against weight-only, cuBLAS and FlashInfer (benchmarks/sweeps/w8a8_bench.py), then decode
#       at the 35B-A3B shape with FP8 weights (batch 1 and 16 at 1K, a 50K prefill; W8A8 on and off) and
#       with FP8 KV pages at 128K against bf16 pages
#   9   the summary table
# A step's GPU is set by CUDA_VISIBLE_DEVICES for single-GPU steps ($GPU, default 0). The PHLOEM_*
# kernel variables a step sets are read by `phloem bench decode` into its KernelConfig (runtime/env.py).
set -u
OUT=${1:?usage: gpu_checks.sh OUT_DIR [STEPS]}
STEPS=${2:-"0 1+3a 6 5 2 3b 4 9"}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PHLOEM_NO_PROGRESS=1
export PHLOEM_DATA_DIR=${PHLOEM_DATA_DIR:-/tmp/phloem-data} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi}
PY="python3 -m phloem.cli"
stamp() { echo "$(date +%T) $*" | tee -a "$OUT/phases.txt"; }
# wait_up PORT PID...: until the server on PORT answers; gives up at once when any PID has exited
# (a server that died at start must not cost the 10 minutes of the timeout: the fifth session's did).
wait_up() {
  local port=$1; shift
  for _ in $(seq 600); do
    curl -s -o /dev/null "http://127.0.0.1:$port/v1/models" && return 0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null || { stamp "server for port $port exited"; return 1; }; done
    sleep 1
  done
  return 1
}

step_0() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} python3 - > "$OUT/0_warmup.txt" 2>&1 <<'PYEOF'
import time
from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig
from phloem.runtime.default_model import ensure_default_model
from phloem.runtime.model_shapes import ensure_shape_model
import os
from pathlib import Path
data = Path(os.environ["PHLOEM_DATA_DIR"])
tiny = ensure_default_model(data)
for dtype in ("bfloat16", "float32"):
    t = time.time()
    e = Engine.from_pretrained(tiny, device="cuda", dtype=dtype, cache=CacheConfig(num_pages=256, num_state_slots=16),
                               scheduler=SchedulerConfig(max_num_seqs=4))
    e.generate([list(range(1, 200)), [5, 6]], SamplingParams(max_tokens=4, ignore_eos=True))
    print(f"tiny {dtype}: {time.time() - t:.0f} s", flush=True)
    del e
t = time.time()
e = Engine.from_pretrained(ensure_shape_model("qwen3.5-35b-a3b", data), load_format="dummy", device="cuda",
                           dtype="bfloat16", cache=CacheConfig(num_pages=2048, num_state_slots=8),
                           scheduler=SchedulerConfig(max_num_seqs=2))
e.generate([list(range(1, 300))], SamplingParams(max_tokens=4, ignore_eos=True))
print(f"35B-A3B shape: {time.time() - t:.0f} s", flush=True)
PYEOF
  local rc=$?
  (cd "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null && find . -name '*.so' | tar czf "$OUT/flashinfer_so.tgz" -T -)
  # Everything after depends on it; a failure here would otherwise reappear as JIT builds and
  # timeouts in every later step.
  [ $rc -eq 0 ] || { stamp "warm-up failed: stopping (see 0_warmup.txt)"; tail -n 5 "$OUT/0_warmup.txt"; exit 1; }
}
step_1() {
  # tests/engine and tests/kernels hold every `gpu` test; tests/api needs packages the GPU image lacks.
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 600 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/engine tests/kernels \
    > "$OUT/1_gpu_tests.txt" 2>&1
}
step_1a() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 580 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/kernels \
    > "$OUT/1a_gpu_tests.txt" 2>&1
}
step_1b() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 580 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/engine \
    > "$OUT/1b_gpu_tests.txt" 2>&1
}
step_2() {
  timeout 600 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/test_gpu_engine.py \
    -k "tensor_parallel or second_gpu" > "$OUT/2_tp_tests.txt" 2>&1
}
BENCH="bench decode --device cuda --batches 1,16 --contexts 1024 --prefill-tokens 0"
step_3a() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 900 $PY $BENCH --out "$OUT/3_tp1.json" > "$OUT/3_tp1.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} PHLOEM_TRITON_GEMV=0 timeout 900 $PY $BENCH --out "$OUT/3_tp1_cublas.json" \
    > "$OUT/3_tp1_cublas.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} PHLOEM_TRITON_GEMV=0 PHLOEM_PDL=0 timeout 900 $PY $BENCH \
    --out "$OUT/3_tp1_cublas_nopdl.json" > "$OUT/3_tp1_cublas_nopdl.txt" 2>&1
}
step_3b() {
  timeout 900 $PY $BENCH --tp 2 --out "$OUT/3_tp2.json" > "$OUT/3_tp2.txt" 2>&1
  PHLOEM_ONE_SHOT_ALLREDUCE=1 timeout 900 $PY $BENCH --tp 2 --out "$OUT/3_tp2_one_shot.json" > "$OUT/3_tp2_one_shot.txt" 2>&1
  timeout 900 $PY $BENCH --tp 2 --ep --out "$OUT/3_tp2_ep.json" > "$OUT/3_tp2_ep.txt" 2>&1
}
step_4() {
  $PY serve --device cuda:0 --dtype bfloat16 --role prefill --pd-peer 127.0.0.1:9555 --port 8200 > "$OUT/4_prefill.log" 2>&1 &
  local p1=$!
  $PY serve --device cuda:1 --dtype bfloat16 --role decode --pd-peer 127.0.0.1:9555 --port 8201 > "$OUT/4_decode.log" 2>&1 &
  local p2=$!
  CUDA_VISIBLE_DEVICES=0 $PY serve --device cuda --dtype bfloat16 --port 8300 > "$OUT/4_colocated.log" 2>&1 &
  local p3=$!
  wait_up 8201 $p1 $p2 && wait_up 8300 $p3 && timeout 600 python3 benchmarks/sweeps/pd_check.py 8201 8300 > "$OUT/4_pd_check.txt" 2>&1
  kill $p1 $p2 $p3 2>/dev/null; wait $p1 $p2 $p3 2>/dev/null
}
step_5() {
  local wl="--modes sessions --agents 1 --first-turn 50000 --append 800 --turns 6 --output 256 --no-progress"
  local srv="--shape qwen3.5-35b-a3b --dtype bfloat16 --max-num-batched-tokens 8192"
  $PY serve $srv --device cuda:0 --role prefill --pd-peer 127.0.0.1:9556 --port 8400 > "$OUT/5_prefill.log" 2>&1 &
  local p1=$!
  $PY serve $srv --device cuda:1 --role decode --pd-peer 127.0.0.1:9556 --port 8401 > "$OUT/5_decode.log" 2>&1 &
  local p2=$!
  wait_up 8401 $p1 $p2 && timeout 900 $PY bench agentic --base-url http://127.0.0.1:8401 $wl --gpus 2 --out "$OUT/5_pd" > "$OUT/5_pd.txt" 2>&1
  kill $p1 $p2 2>/dev/null; wait $p1 $p2 2>/dev/null
  CUDA_VISIBLE_DEVICES=0 $PY serve $srv --device cuda --port 8402 > "$OUT/5_colocated.log" 2>&1 &
  local p3=$!
  wait_up 8402 $p3 && timeout 900 $PY bench agentic --base-url http://127.0.0.1:8402 $wl --gpus 1 --out "$OUT/5_colocated" > "$OUT/5_colocated.txt" 2>&1
  kill $p3 2>/dev/null; wait $p3 2>/dev/null
}
step_6() {
  timeout 300 python3 benchmarks/sweeps/allreduce_bench.py > "$OUT/6_allreduce.txt" 2>&1
}
step_7() {
  # GEMV_TOP=FILE: only the best configurations of an earlier sweep; else the whole grid.
  local grid=${GEMV_TOP:+--top $GEMV_TOP}
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 600 python3 benchmarks/sweeps/gemv_sweep.py $grid --out "$OUT/7_gemv.json" > "$OUT/7_gemv.txt" 2>&1
}
step_8() {
  local v
  declare -A envs=([unfused]=PHLOEM_FUSED_DECODE=0 [fused]=PHLOEM_PDL=0 [fused_pdl]=PHLOEM_PDL=1 [cublas]=PHLOEM_TRITON_GEMV=0)
  for v in ${DECODE_VARIANTS:-unfused fused fused_pdl}; do
    CUDA_VISIBLE_DEVICES=${GPU:-0} env "${envs[$v]}" timeout 600 $PY $BENCH --out "$OUT/8_$v.json" > "$OUT/8_$v.txt" 2>&1
  done
}
step_11() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 600 $PY bench decode --device cuda --batches 1,4,16,64 --contexts 1024,32768,131072 \
    --prefill-tokens 50000 --out "$OUT/11_decode.json" > "$OUT/11_decode.txt" 2>&1
}
step_12() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 $PY bench decode --device cuda --batches 1 --contexts 1024,32768,131072 \
    --prefill-tokens 0 --out "$OUT/12_decode_b1.json" > "$OUT/12_decode_b1.txt" 2>&1
}
step_13() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 benchmarks/sweeps/moe_token_sweep.py --out "$OUT/13_moe_token.json" \
    > "$OUT/13_moe_token.txt" 2>&1
}
step_15() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 benchmarks/sweeps/decode_attention_bench.py --out "$OUT/15_attn.json" > "$OUT/15_attn.txt" 2>&1
}
step_16() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/kernels/test_triton_moe_token.py \
    tests/kernels/test_triton_fused_linear.py tests/kernels/test_triton_fused_moe.py tests/kernels/test_triton_decode_attention.py \
    tests/kernels/test_triton_env.py \
    > "$OUT/16_kernel_tests.txt" 2>&1
}
step_17() {
  local b1="bench decode --device cuda --batches 1 --contexts 1024 --prefill-tokens 0"
  CUDA_VISIBLE_DEVICES=${GPU:-0} PHLOEM_TRITON_DECODE_ATTENTION=0 timeout 300 $PY $b1 --out "$OUT/17_flashinfer.json" \
    > "$OUT/17_flashinfer.txt" 2>&1
}
step_20() {
  local b1="bench decode --device cuda --batches ${DECODE_BATCHES:-1} --contexts 1024 --prefill-tokens 0 ${DECODE_ARGS:-}" spec name vars
  for spec in ${DECODE_ENVS:-"default:PHLOEM_PDL=1"}; do
    name=${spec%%:*} vars=${spec#*:}
    CUDA_VISIBLE_DEVICES=${GPU:-0} env ${vars//+/ } timeout 300 $PY $b1 --out "$OUT/20_$name.json" > "$OUT/20_$name.txt" 2>&1
    # (a prefix written by awk, not sed: a value may hold the characters sed would take as its syntax)
    grep '^| [0-9]' "$OUT/20_$name.txt" | awk -v p="20_$name ($vars): " '{ print p $0 }' >> "$OUT/20_summary.txt"
  done
}
step_21() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 benchmarks/sweeps/step_trace.py --out "$OUT/21_trace.json" > "$OUT/21_trace.txt" 2>&1
}
step_23() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 540 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/kernels/test_triton_gdn_decode.py \
    tests/kernels/test_triton_argmax.py tests/kernels/test_triton_moe_token.py tests/kernels/test_triton_fused_moe.py \
    tests/engine/test_gpu_engine.py > "$OUT/23_tests.txt" 2>&1  # ~7 min
}
step_24() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/engine/test_gpu_engine.py > "$OUT/24_engine_tests.txt" 2>&1
}
step_25() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    tests/kernels/test_triton_decode_attention_prologue.py tests/kernels/test_triton_decode_attention.py \
    tests/kernels/test_triton_qk_norm_rope.py tests/kernels/test_triton_argmax.py tests/runtime/test_measure_bandwidth.py \
    > "$OUT/25_kernel_tests.txt" 2>&1
}
step_26() {
  local files=${GPU_TESTS:-"tests/kernels/test_triton_fused_linear.py tests/kernels/test_triton_gemv.py tests/kernels/test_triton_moe_token.py tests/kernels/test_triton_fused_moe.py tests/kernels/test_triton_route_partial.py"}
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu $files \
    > "$OUT/26_gemv_moe_tests.txt" 2>&1
}
step_30() {
  # Batch-1 decode at 32K and 128K once per environment in $LONG_ENVS (as step 20's $DECODE_ENVS).
  DECODE_ENVS=${LONG_ENVS:-"default_long:PHLOEM_PDL=1"} DECODE_ARGS="--contexts 32768,131072 --steps 30" step_20
}
step_31() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 120 python3 benchmarks/sweeps/gdn_host.py > "$OUT/31_gdn_host.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 benchmarks/sweeps/prefill_attention_bench.py > "$OUT/31_prefill_attn.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 python3 benchmarks/sweeps/mixed_step.py --context 57344 \
    --attention one-call --attention split > "$OUT/31_mixed_step.txt" 2>&1
}
step_32() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 500 python3 -m pytest -q -p no:cacheprovider -rfE -s \
    tests/engine/test_gpu_concurrency.py tests/engine/test_gpu_trained_model.py tests/engine/test_gpu_switches.py \
    > "$OUT/32_concurrency_tests.txt" 2>&1
}
step_10() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 benchmarks/sweeps/host_profile.py > "$OUT/10_host.txt" 2>&1
}
SRV="--server-arg=--device --server-arg=cuda --server-arg=--dtype --server-arg=bfloat16 --server-arg=--shape --server-arg=qwen3.5-35b-a3b"
run_tests() {  # NAME TIMEOUT PATHS...: one pytest group with its own last-failed cache
  local name=$1 t=$2; shift 2
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout "$t" python3 -m pytest -q -o cache_dir="/tmp/pc_$name" -rfE -m gpu --continue-on-collection-errors "$@" \
    > "$OUT/40_$name.txt" 2>&1
}
rerun_failed() {  # NAME PATHS...: the group's failures alone, with nothing beside them on the card
  local name=$1; shift
  grep -qE "^(FAILED|ERROR)" "$OUT/40_$name.txt" || return 0
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 -m pytest -q -o cache_dir="/tmp/pc_$name" -rfE -m gpu --lf "$@" \
    > "$OUT/40_${name}_rerun.txt" 2>&1
}
step_40() {
  run_tests kernels ${TEST_TIMEOUT:-420} tests/kernels &
  local k=$!
  run_tests engine ${TEST_TIMEOUT:-420} tests/engine
  wait $k
  run_tests rest 240 tests/api tests/runtime
  rerun_failed kernels tests/kernels; rerun_failed engine tests/engine; rerun_failed rest tests/api tests/runtime
}
step_41() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 $PY bench decode --device cuda --batches 1,16 --contexts 1024 --prefill-tokens 0 \
    --grammar --out "$OUT/41_grammar.json" > "$OUT/41_grammar.txt" 2>&1
}
step_42() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 500 $PY bench agentic --shared-prefix 8000 --agents 16 --turns 3 --append 800 \
    --output 128 --modes sessions,stateless $SRV --no-progress --out /tmp/o42 > "$OUT/42_shared_prefix.txt" 2>&1
  cp /tmp/o42/shared_prefix.json "$OUT/42_shared_prefix.json" 2>/dev/null
}
step_43() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 700 $PY bench agentic --modes sessions,stateless --agents 16 --first-turn 50000 \
    --append 800 --turns 12 --output 500 $SRV --no-progress --out /tmp/o43 > "$OUT/43_agentic.txt" 2>&1
  cp /tmp/o43/agentic.json "$OUT/43_agentic.json" 2>/dev/null
}
step_44() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 580 python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
    tests/engine/test_gpu_mtp_speculation.py tests/benchmarks/test_speculative_decode.py > "$OUT/44_speculation_tests.txt" 2>&1
}
step_45() {
  for k in 1 2 3; do
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 900 $PY bench decode --device cuda --speculative mtp:$k --batches 1,16 \
      --contexts 1024 --prefill-tokens 0 --accept-length 3.1 --no-progress --out "$OUT/45_spec_mtp$k.json" \
      > "$OUT/45_spec_mtp$k.txt" 2>&1
  done
}
step_46() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 580 python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
    tests/kernels/test_triton_gemv_fp8.py tests/kernels/test_triton_moe_fp8.py tests/kernels/test_triton_w8a8.py \
    tests/kernels/test_flashinfer_fp8_kv.py tests/engine/test_fp8_cache_paths.py tests/engine/test_gpu_fp8_model.py \
    tests/engine/test_gpu_pool_sizing.py \
    > "$OUT/46_fp8_tests.txt" 2>&1
}
step_47() {
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 benchmarks/sweeps/gemv_fp8_bench.py > "$OUT/47_gemv_fp8.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 300 python3 benchmarks/sweeps/w8a8_bench.py --out "$OUT/47_w8a8.json" \
    > "$OUT/47_w8a8.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 500 $PY bench decode --device cuda --quantization fp8 --batches 1,16 \
    --contexts 1024 --prefill-tokens 50000 --no-progress --out "$OUT/47_decode_fp8.json" > "$OUT/47_decode_fp8.txt" 2>&1
  CUDA_VISIBLE_DEVICES=${GPU:-0} PHLOEM_FP8_W8A8=1 timeout 300 $PY bench decode --device cuda --quantization fp8 \
    --batches 16 --contexts 1024 --prefill-tokens 50000 --no-progress --out "$OUT/47_decode_w8a8.json" \
    > "$OUT/47_decode_w8a8.txt" 2>&1
  for kv in auto fp8_e4m3; do
    CUDA_VISIBLE_DEVICES=${GPU:-0} timeout 400 $PY bench decode --device cuda --kv-cache-dtype $kv --batches 1 \
      --contexts 131072 --prefill-tokens 0 --no-progress --out "$OUT/47_kv_$kv.json" > "$OUT/47_kv_$kv.txt" 2>&1
  done
}
step_9() {
  echo; echo "== summary =="
  cat "$OUT/0_warmup.txt" 2>/dev/null
  for f in "$OUT"/40_*.txt; do [ -f "$f" ] && { echo "$(basename "$f"): $(tail -n 1 "$f")"; grep -E "^(FAILED|ERROR)" "$f" | head -n 12; }; done
  [ -f "$OUT/41_grammar.txt" ] && grep -v Warning "$OUT/41_grammar.txt" | grep '^|\|copy' | head -n 6
  for f in 42_shared_prefix 43_agentic; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep -v Warning "$OUT/$f.txt" | grep '^|' | head -n 24; }; done
  for f in 1_gpu_tests 1a_gpu_tests 1b_gpu_tests 2_tp_tests; do [ -f "$OUT/$f.txt" ] && echo "$f: $(tail -n 1 "$OUT/$f.txt")"; done
  for f in 7_gemv 7_gemv_nopdl; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep '^|' "$OUT/$f.txt" | grep -v '| plain |' ; grep 'plain' "$OUT/$f.txt" | head -n 12; }; done
  for f in 8_unfused 8_fused 8_fused_pdl 8_cublas; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; head -n 1 "$OUT/$f.txt"; grep '^| 1 \|^| 16 \|launches' "$OUT/$f.txt"; }; done
  [ -f "$OUT/8_fused.txt" ] && grep -A 26 'launches' "$OUT/8_fused.txt"
  [ -f "$OUT/11_decode.txt" ] && grep -v Warning "$OUT/11_decode.txt" | grep '^|\|prefill\|launches\|kernels' | head -n 48
  [ -f "$OUT/12_decode_b1.txt" ] && grep -v Warning "$OUT/12_decode_b1.txt" | grep '^|\|launches\|kernels' | head -n 30
  [ -f "$OUT/16_kernel_tests.txt" ] && echo "16_kernel_tests: $(tail -n 1 "$OUT/16_kernel_tests.txt")"
  [ -f "$OUT/20_summary.txt" ] && cat "$OUT/20_summary.txt"
  for f in 17_flashinfer; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep -v Warning "$OUT/$f.txt" | grep '^|\|launches\|kernels' | head -n 30; }; done
  for f in 13_moe_token 15_attn; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep -v Warning "$OUT/$f.txt" | tail -n 40; }; done
  [ -f "$OUT/23_tests.txt" ] && echo "23_tests: $(tail -n 1 "$OUT/23_tests.txt")"
  [ -f "$OUT/24_engine_tests.txt" ] && echo "24_engine_tests: $(tail -n 1 "$OUT/24_engine_tests.txt")"
  [ -f "$OUT/26_gemv_moe_tests.txt" ] && { echo "26_gemv_moe_tests: $(tail -n 1 "$OUT/26_gemv_moe_tests.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/26_gemv_moe_tests.txt" | head -n 20; }
  [ -f "$OUT/25_kernel_tests.txt" ] && { echo "25_kernel_tests: $(tail -n 1 "$OUT/25_kernel_tests.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/25_kernel_tests.txt" | head -n 20; }
  for f in "$OUT"/20_*.json; do [ -f "$f" ] && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].rsplit('/',1)[-1], 'bw', round(d['bandwidth']/1e12,3), 'host', round(d.get('bandwidth_host_timed',0)/1e12,3), 'after', round(d.get('bandwidth_after_grid',0)/1e12,3), [(r['batch'], round(r['ms_per_step'],3), r['gpu_ms_per_step'] and round(r['gpu_ms_per_step'],3), round(r['roofline_fraction'],3)) for r in d['decode']])" "$f"; done
  [ -f "$OUT/21_trace.txt" ] && { echo "21_trace:"; grep -v Warning "$OUT/21_trace.txt" | tail -n 30; }
  [ -f "$OUT/10_host.txt" ] && grep -v Warning "$OUT/10_host.txt" | head -n 40
  [ -f "$OUT/31_gdn_host.txt" ] && grep -v Warning "$OUT/31_gdn_host.txt" | head -n 5
  [ -f "$OUT/31_prefill_attn.txt" ] && grep -v Warning "$OUT/31_prefill_attn.txt" | tail -n 12
  [ -f "$OUT/31_mixed_step.txt" ] && grep -v Warning "$OUT/31_mixed_step.txt" | grep -v '^  ' | head -n 45
  [ -f "$OUT/44_speculation_tests.txt" ] && { echo "44: $(tail -n 1 "$OUT/44_speculation_tests.txt")"; grep -E "accepted length|NOT a tie|^FAILED" "$OUT/44_speculation_tests.txt" | head -n 12; }
  for k in 1 2 3; do [ -f "$OUT/45_spec_mtp$k.txt" ] && { echo "45 mtp:$k:"; grep -v Warning "$OUT/45_spec_mtp$k.txt" | grep '^| 1 \|^| 16 \|^projection'; }; done
  [ -f "$OUT/46_fp8_tests.txt" ] && { echo "46: $(tail -n 1 "$OUT/46_fp8_tests.txt")"; grep -E "FP8 vs bf16|NOT a tie|^FAILED|^ERROR" "$OUT/46_fp8_tests.txt" | head -n 12; }
  for f in 47_gemv_fp8 47_w8a8; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep -v Warning "$OUT/$f.txt" | grep '^|' | head -n 30; }; done
  for f in 47_decode_fp8 47_decode_w8a8 47_kv_auto 47_kv_fp8_e4m3; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep -v Warning "$OUT/$f.txt" | grep '^|\|prefill\|copy' | head -n 8; }; done
  [ -f "$OUT/32_concurrency_tests.txt" ] && { echo "32: $(tail -n 1 "$OUT/32_concurrency_tests.txt")"; grep -E "differs|^FAILED" "$OUT/32_concurrency_tests.txt" | head -n 12; }
  for f in 3_tp1 3_tp1_cublas 3_tp1_cublas_nopdl 3_tp2 3_tp2_one_shot 3_tp2_ep; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep '^| 1\|^| 16' "$OUT/$f.txt"; }; done
  [ -f "$OUT/4_pd_check.txt" ] && echo "4_pd_check: $(tail -n 1 "$OUT/4_pd_check.txt")"
  for f in 5_pd 5_colocated; do [ -f "$OUT/$f.txt" ] && { echo "$f:"; grep '^| sessions' "$OUT/$f.txt"; }; done
  [ -f "$OUT/6_allreduce.txt" ] && tail -n 12 "$OUT/6_allreduce.txt"
}

for s in $STEPS; do
  if [[ $s == *+* ]]; then
    a=${s%+*} b=${s#*+}
    stamp "$a on GPU 0 + $b on GPU 1"
    GPU=0 "step_$a" & pa=$!
    GPU=1 "step_$b" & pb=$!
    wait $pa $pb
  else
    stamp "$s"
    "step_$s"
  fi
done
stamp "done"
