"""Registers, spills and shared memory of the decode kernels as the GPU loads them (what an
offline ``ptxas -v`` can only estimate: it compiled the attention to 210 registers where the GPU
loads 118), and how many programs of each fit an SM.

    python3 benchmarks/sweeps/kernel_regs.py [CONFIG ...]   # e.g. 32,4,2,16 32,4,2,16,128
    python3 benchmarks/sweeps/kernel_regs.py --decode       # every one-token kernel, default tiles

CONFIG is ``DecodeAttentionConfig``'s fields, comma-separated. Each one runs one launch of
``paged_decode_attention_prologue`` at the 35B-A3B shape (16 query / 2 KV heads of 256, pages of
16, 1K keys). ``--decode`` runs the GEMV projections (``gemv_sweep.fused_cases``), the
one-token MoE stages (also as the router-in-projection path reads them) and the GDN decode step
once each at that shape, with the tiles the
kernels ship (``gemv_config``, ``moe_token.DEFAULT_CONFIG`` and the like).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from phloem.kernels.attention import triton_decode as da
from phloem.kernels.attention.rope import rope_inv_freq
from phloem.kernels.common.device import resident_programs

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


def report(kernels: dict, run) -> None:
    """Run ``run()`` and print every variant of the Triton kernels (``{label: kernel}``) it compiled."""
    props = torch.cuda.get_device_properties(0)
    before = {what: set(kernel.device_caches[0][0]) for what, kernel in kernels.items()}
    run()
    torch.cuda.synchronize()
    for what, kernel in kernels.items():
        cache = kernel.device_caches[0][0]
        for key in set(cache) - before[what]:
            k = cache[key]
            print(f"{what}: {k.n_regs} registers, {k.n_spills} spills, {k.metadata.shared} B shared, "
                  f"{k.metadata.num_warps} warps, {resident_programs(k, props)} programs an SM", flush=True)  # fmt: skip


def decode_kernels() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from gemv_sweep import SHAPES, fused_cases, weights

    from phloem.kernels.gdn import triton_decode as gdn_decode
    from phloem.kernels.linear import triton_gemv as gemv
    from phloem.kernels.moe import triton_decode as fused_moe

    for name in ("in_proj", "qkv_proj", "out_proj", "router", "lm_head"):
        ws = weights(name)[:1]
        if name == "lm_head":
            x = torch.randn(1, SHAPES[name][1], device="cuda", dtype=torch.bfloat16)
            report({name: gemv.gemv_kernel}, lambda: gemv.linear(x, ws[0]))
        for variant, fused, _, _ in fused_cases(name, ws):
            report({f"{name} {variant}": gemv.gemv_kernel}, lambda fused=fused: fused(ws[0]))
    dev, bf = torch.device("cuda"), torch.bfloat16
    w_gu = torch.randn(257, 1024, 2048, device=dev, dtype=bf) * 0.02
    w_d = torch.randn(257, 2048, 512, device=dev, dtype=bf) * 0.02
    x, logits = torch.randn(1, 2048, device=dev, dtype=bf), torch.randn(1, 257, device=dev, dtype=bf)
    run = lambda: fused_moe.fused_moe_token_routed(x, logits, w_gu, w_d, 8, True)  # noqa: E731
    report({"moe gate/up (routed)": fused_moe.moe_token._gate_up_token_kernel, "moe down + sum": fused_moe._down_sum_kernel}, run)
    # The router folded into the output projection (kernels/moe/route_partial.py): out_proj's route
    # epilogue, and the experts reading the accumulator.
    from phloem.kernels.moe.route_partial import new_route_acc

    acc, router_t, post_w = new_route_acc(257, dev), torch.randn(2048, 257, device=dev, dtype=bf) * 0.02, x[0]
    o, z = torch.randn(1, 32, 128, device=dev, dtype=bf), torch.randn(1, 32, 128, device=dev, dtype=bf)
    w_out, norm_w = weights("out_proj")[0], torch.ones(128, device=dev, dtype=bf)
    route = lambda: gemv.gated_rms_norm_linear_route(o, z, norm_w, 1e-6, w_out, x, router_t, post_w, acc)  # noqa: E731
    report({"out_proj (route epilogue)": gemv.gemv_kernel}, route)
    run = lambda: fused_moe.fused_moe_token_route_partial(x, acc, post_w, 1e-6, w_gu, w_d, 8, True)  # noqa: E731
    report({"moe gate/up (route partial)": fused_moe.moe_token._gate_up_token_kernel,
            "moe down + sum (zeroing)": fused_moe._down_sum_kernel}, run)  # fmt: skip
    qkv = torch.randn(1, 2 * 2048 + 4096, device=dev, dtype=bf)
    q, k, v = qkv[:, :2048].view(1, 16, 128), qkv[:, 2048:4096].view(1, 16, 128), qkv[:, 4096:].view(1, 32, 128)
    ab = torch.randn(1, 64, device=dev, dtype=bf)
    states = torch.randn(4, 32, 128, 128, device=dev)
    slots = torch.tensor([1], device=dev)
    a_log, dt_bias = torch.randn(32, device=dev), torch.randn(32, device=dev)
    step = lambda: gdn_decode.recurrent_gated_delta_rule_with_gates(q, k, v, ab[:, :32], ab[:, 32:], a_log, dt_bias, states, slots, slots)  # noqa: E731
    report({"gdn decode step": gdn_decode.recurrent_gated_delta_rule_kernel}, step)


def main() -> None:
    if sys.argv[1:] == ["--decode"]:
        decode_kernels()
        return
    for spec in sys.argv[1:] or [",".join(str(v) for v in da.DecodeAttentionConfig())]:
        config = da.DecodeAttentionConfig(*(int(v) for v in spec.split(",")))
        report({f"attention split, config {tuple(config)}": da.decode_attention_split_kernel}, lambda c=config: launch(c))


if __name__ == "__main__":
    main()
