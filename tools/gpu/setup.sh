#!/bin/bash
# Source at the start of every device call, from the repository root:
#   source tools/gpu/setup.sh
# Installs the carried wheels (.whl/ and, when carried, .whl-client/: tools/gpu/fetch_wheels.sh) into /tmp/site, makes
# this checkout importable as `phloem` (/tmp/pkg/phloem -> here), and restores the kernel caches
# an earlier machine packed (.gpu-cache/: FlashInfer's JIT-built libraries, installed as its AOT
# modules so they load without a build check; Triton's cache), so a fresh machine does not compile
# them again. `pack_caches DIR` writes them out: copy DIR's .tgz files into .gpu-cache/ and carry it.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl $(ls .whl-client/*.whl 2>/dev/null) \
  >/tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; return 1; }
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/phloem
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD
export PATH=/tmp/site/bin:$PATH
FI_AOT=/tmp/site/flashinfer/data/aot
if [ -f .gpu-cache/flashinfer_ops.tgz ]; then mkdir -p $FI_AOT && tar xzf .gpu-cache/flashinfer_ops.tgz -C $FI_AOT; fi
if [ -f .gpu-cache/triton_cache.tgz ]; then tar xzf .gpu-cache/triton_cache.tgz -C /; fi
pack_caches() {
  # cached_ops/NAME/NAME.so -> NAME/NAME.so under FlashInfer's AOT directory when restored.
  (cd /root/.cache/flashinfer/*/*/cached_ops 2>/dev/null && ls -d */ | while read -r d; do
     [ -f "$d${d%/}.so" ] && echo "$d${d%/}.so"; done | tar czf "$1/flashinfer_ops.tgz" -T -)
  # A cache hit loads only a kernel's metadata (.json) and binary (.cubin) and the launchers
  # (.so); the IR and source files are two thirds of the bytes, and the carry is capped.
  tar czf "$1/triton_cache.tgz" --exclude='*.llir' --exclude='*.ptx' --exclude='*.ttir' --exclude='*.ttgir' \
    --exclude='*.source' -C / root/.triton/cache 2>/dev/null
  ls -la "$1"/*.tgz
}
# Exported: the device scripts (fleet.sh's WARM=1) run in child shells of the one that sourced this.
export -f pack_caches
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
# One kernel cache for every process of a call (tests, benchmarks, `phloem serve`), the one the
# carried .gpu-cache archives fill.
export TRITON_CACHE_DIR=/root/.triton/cache FLASHINFER_WORKSPACE_BASE=/root
