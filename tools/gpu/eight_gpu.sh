#!/bin/bash
# The eight-GPU run of issue 54 in one device call: benchmarks/eight_gpu.py (its docstring lists
# what each section measures), its table in OUT_DIR/eight_gpu.md, raw rows in eight_gpu.json.
#
#   bash tools/gpu/eight_gpu.sh OUT_DIR [SECTIONS]   # from the repository root, phloem importable
#
# SECTIONS (default flagship,fp8,simulate,scaling) splits the run over several calls when one
# call's time is short: each section loads its own engines. --dry (CPU, gloo, tiny shape) is the
# CI check of the same code: python3 -m phloem.benchmarks.eight_gpu --dry --out DIR.
# NVLink multicast stays off (no NVLS, no multimem): peer loads and stores only.
set -euo pipefail
out=${1:?usage: bash tools/gpu/eight_gpu.sh OUT_DIR [SECTIONS]}
sections=${2:-flagship,fp8,simulate,scaling}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
gpus=$(nvidia-smi -L | tee "$out/gpus.txt" | wc -l)
if [ "$gpus" -lt 8 ]; then
    echo "eight_gpu.sh: needs 8 GPUs, found $gpus (nvidia-smi -L)" >&2
    exit 2
fi
date -u +"%Y-%m-%dT%H:%MZ" > "$out/date.txt"
python3 -m phloem.benchmarks.eight_gpu --out "$out" --sections "$sections" 2>&1 | tee "$out/eight_gpu.log"
