#!/bin/bash
# Device call: the GPU tests of the served path and the decode benchmark with its served and
# grammar columns. From the repository root: bash tools/gpu/check_served.sh   (writes $OUT)
source tools/gpu/setup.sh || exit 1
set -o pipefail
T0=$(date +%s)
timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 300 -rf \
  tests/engine/test_gpu_concurrency.py tests/engine/test_constrained_decoding.py tests/engine/test_warmup.py \
  tests/engine/test_step_budget.py tests/kernels/test_triton_argmax.py \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|PASS|FAIL" | tail -15
echo "tests: $(( $(date +%s) - T0 )) s"
pack_caches "$OUT" >/dev/null
T1=$(date +%s)
timeout 240 python3 -m phloem.cli bench decode --device cuda --batches 1,16 --contexts 1024,57344 \
  --prefill-tokens 50000 --grammar --no-progress --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | grep -v Warning | tail -14
echo "bench: $(( $(date +%s) - T1 )) s"
