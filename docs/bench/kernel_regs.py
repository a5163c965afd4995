"""Registers, spills and shared memory of the split-KV decode attention as the GPU loads it, per
preload mode and launch configuration (what an offline ``ptxas -v`` can only estimate).

    python3 docs/bench/kernel_regs.py [MODE:CONFIG ...]   # e.g. 0:32,4,2,16 1:32,4,2,16,128

MODE is ``decode_attention.PRELOAD_FIRST_TILE`` (0 off, 1 the one-tile splits' tile in registers,
2 pulled into L2); CONFIG is ``DecodeAttentionConfig``'s fields, comma-separated. Each pair runs one
launch of ``paged_decode_attention_prologue`` at the 35B-A3B shape (16 query / 2 KV heads of 256,
pages of 16, 1K keys) and prints the kernel's resource use and how many programs fit an SM.
"""

from __future__ import annotations

import sys

import torch

from phloem.kernels.rope import rope_inv_freq
from phloem.kernels.triton import decode_attention as da

PAGE, HQ, HKV, D, CONTEXT = 16, 16, 2, 256, 1024


def launch(config: da.DecodeAttentionConfig) -> None:
    dev, bf = torch.device("cuda"), torch.bfloat16
    pages = CONTEXT // PAGE
    cache = torch.randn(pages + 1, 2, PAGE, HKV, D, device=dev, dtype=bf)
    qkv = torch.randn(1, HQ * 2 * D + 2 * HKV * D, device=dev, dtype=bf)
    q_gate, key, value = torch.split(qkv, [HQ * 2 * D, HKV * D, HKV * D], dim=-1)
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)
    indices = torch.randperm(pages, device=dev).to(torch.int32)
    last = torch.tensor([PAGE], dtype=torch.int32, device=dev)
    slot = (indices[-1].long() * PAGE + PAGE - 1).view(1)
    norm_w = torch.randn(D, device=dev, dtype=bf) * 0.1
    saved = da._DEFAULT_CONFIG
    da._DEFAULT_CONFIG = config
    try:
        da.paged_decode_attention_prologue(
            q_gate.view(1, HQ, 2 * D), key.view(1, HKV, D), value.view(1, HKV, D), norm_w, norm_w,
            torch.tensor([CONTEXT - 1], device=dev), rope_inv_freq(64, 1e7).to(dev), 1e-6, cache, slot,
            indptr, indices, last, D**-0.5,
        )  # fmt: skip
    finally:
        da._DEFAULT_CONFIG = saved
    torch.cuda.synchronize()


def main() -> None:
    specs = sys.argv[1:] or ["0:32,4,2,16", "1:32,4,2,16", "2:32,4,2,16"]
    props = torch.cuda.get_device_properties(0)
    for spec in specs:
        mode, _, fields = spec.partition(":")
        config = da.DecodeAttentionConfig(*(int(v) for v in fields.split(",")))
        da.PRELOAD_FIRST_TILE = int(mode)
        cache = da.decode_attention_split_kernel.device_caches[0][0]
        before = set(cache)
        launch(config)
        for key in set(cache) - before:
            k = cache[key]
            threads = 32 * config.num_warps
            fit = min(props.max_threads_per_multi_processor // threads, 65536 // max(1, k.n_regs * threads),
                      props.shared_memory_per_multiprocessor // max(1, k.metadata.shared))  # fmt: skip
            print(f"preload {mode} config {tuple(config)}: {k.n_regs} registers, {k.n_spills} spills, "
                  f"{k.metadata.shared} B shared, {fit} programs an SM", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
