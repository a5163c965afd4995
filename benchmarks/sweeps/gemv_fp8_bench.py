"""Time the one-token GEMV (``kernels/linear/triton_gemv.py``) on a block-FP8 weight against the same
GEMV on the bf16 weight and against the dequantize-on-read path (``engine.models._fp8``: the weight
dequantized to bf16 every read, then the bf16 GEMV), on the GPU, CUDA-graph replays over 8 distinct
weights (nothing served from L2).

    python3 benchmarks/sweeps/gemv_fp8_bench.py [--sweep]

Shapes: the 35B-A3B projections Qwen's FP8 release quantizes (attention ``qkv_proj``, ``o_proj``;
GDN ``out_proj``). ``--sweep`` also times the FP8 GEMV in a grid of launch configurations. Every
variant is checked against an fp32 reference on the dequantized weight before it is timed. Prints
Markdown.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from phloem.benchmarks.decode import graph_us, measure_bandwidth
from phloem.kernels.linear import reference as ref
from phloem.kernels.linear import triton_gemv as gemv
from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize

H, HQD, VD = 2048, 4096, 4096
SHAPES = {"qkv_proj": (2 * HQD + 1024, H), "o_proj / out_proj": (H, VD)}
DT = torch.bfloat16
LAYERS = 8


def weights(n: int, k: int) -> list[Fp8Weight]:
    gen = torch.Generator(device="cuda").manual_seed(n)
    out = []
    for _ in range(LAYERS):
        data, scale = fp8_block_quantize(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5, (1, 128))
        out.append(Fp8Weight(data, scale, DT))
    return out


def check(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2 and not got.isnan().any(), (what, err)


def _f32(w: Fp8Weight) -> Fp8Weight:
    return Fp8Weight(w.data, w.scale_inv, torch.float32)


def rows_for(name: str, sweep: bool) -> list[tuple[str, str, float, int]]:
    n, k = SHAPES[name]
    ws = weights(n, k)
    dense = [w.dense() for w in ws]
    x, res = torch.randn(1, k, device="cuda", dtype=DT), torch.randn(1, k, device="cuda", dtype=DT)
    nw = torch.randn(k, device="cuda", dtype=DT) * 0.1
    fp8_bytes, bf16_bytes = n * k + n * -(-k // 128) * 4, n * k * 2
    want = ref.linear(x.float(), _f32(ws[0]))
    check(gemv.linear(x, ws[0]), want, "fp8")
    out = [
        (name, "linear, bf16 weight", graph_us(lambda: [gemv.linear(x, w) for w in dense], LAYERS), bf16_bytes),
        (name, "linear, dequantize on read + bf16", graph_us(lambda: [gemv.linear(x, w.dense()) for w in ws], LAYERS), fp8_bytes),
        (name, "linear, FP8 weight", graph_us(lambda: [gemv.linear(x, w) for w in ws], LAYERS), fp8_bytes),
    ]
    fused = {
        "add_rms_norm_linear": lambda w: gemv.add_rms_norm_linear(x, res, nw, 1e-6, w)[0],
        "sigmoid_gate_linear": lambda w: gemv.sigmoid_gate_linear(x, res, w),
    }
    for variant, op in fused.items():
        out.append((name, f"{variant}, bf16 weight", graph_us(lambda: [op(w) for w in dense], LAYERS), bf16_bytes))
        out.append((name, f"{variant}, FP8 weight", graph_us(lambda: [op(w) for w in ws], LAYERS), fp8_bytes))
    if sweep:
        for bn, warps, pps in itertools.product((2, 4, 8, 16), (4, 8), (2, 4)):
            c = gemv.GemvConfig(bn, warps, 1, pps, True)
            if bn * k > 32768:
                continue
            check(gemv.linear_tuned(x, ws[0], c), want, c)
            us = graph_us(lambda: [gemv.linear_tuned(x, w, c) for w in ws], LAYERS)
            out.append((name, f"linear, FP8 weight, {tuple(c)}", us, fp8_bytes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also a grid of FP8 launch configurations")
    args = parser.parse_args()
    bandwidth = measure_bandwidth(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s\n")
    print("| shape | variant | µs | TB/s (weight bytes read) |\n|---|---|---|---|")
    for name in SHAPES:
        for shape, variant, us, nbytes in rows_for(name, args.sweep):
            print(f"| {shape} | {variant} | {us:.2f} | {nbytes / us / 1e6:.2f} |", flush=True)


if __name__ == "__main__":
    main()
