"""Time the block-FP8 dense projections of a prefill or batched step on the GPU: W8A8 (the Triton
activation quantization + FP8 tensor-core GEMM, ``kernels/linear/triton_w8a8.py``) against the
weight-only path (the weight dequantized on read, then cuBLAS bf16), cuBLAS on resident bf16
weights, and FlashInfer's sm_90 block-scale GEMM where it imports.

    python3 benchmarks/sweeps/w8a8_bench.py [--tokens 64 256 1024 4096 16384] [--out w8a8.json]

Shapes: the 35B-A3B dense projections at TP 1 (bf16 model), weights quantized in 128x128 blocks
as Qwen's FP8 releases are (stored row-expanded, ``Fp8Weight``; FlashInfer takes the 128x128 scales).
Each path is checked before it is timed: its relative Frobenius error from the reference of its kind
(``fp8_w8a8_block_matmul_reference`` for the W8A8 paths, the bf16 matmul on the dequantized weight
for the others) is printed beside its time, and a path over 1e-2 is flagged rather than hidden.
Times are device µs a call from CUDA-graph replays (``benchmarks.decode.graph_us``). Prints Markdown;
``--out`` writes the rows as JSON. Its results are what ``docs/decisions.md``'s W8A8 row awaits.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize

SHAPES = {  # name: (N, K)
    "qkv_proj": (9216, 2048),
    "o_proj / out_proj": (2048, 4096),
}
TOKENS = (64, 256, 1024, 4096, 16384)
DT = torch.bfloat16


def make_weight(n: int, k: int, seed: int) -> tuple[Fp8Weight, torch.Tensor]:
    """The FP8 weight (row-expanded scales) and its 128x128 block scales ``[N/128, K/128]``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    data, blocks = fp8_block_quantize(w, (128, 128))
    rows = blocks.repeat_interleave(128, dim=0)[:n]
    return Fp8Weight(data.cuda(), rows.cuda(), DT), blocks.cuda()


def paths(weight: Fp8Weight, blocks: torch.Tensor) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> (reference kind, ``x -> y``)."""
    from phloem.kernels.linear import triton_w8a8

    resident = weight.dense()
    out: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
        "weight-only (dequant + cuBLAS)": ("weight-only", lambda x: F.linear(x, weight.dense())),
        "cuBLAS on resident bf16": ("weight-only", lambda x: F.linear(x, resident)),
        "W8A8 Triton (quant + GEMM)": ("w8a8", lambda x: triton_w8a8.fp8_w8a8_linear(x, weight)),
    }
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except ImportError:
        return out
    # bf16 activations quantized inside FlashInfer's launch; FP8 weight with its 128x128 block scales.
    out["FlashInfer fp8_blockscale_gemm_sm90"] = (
        "w8a8", lambda x: fp8_blockscale_gemm_sm90(x, weight.data, None, blocks, out_dtype=DT))
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def bench(tokens: tuple[int, ...]) -> list[dict[str, object]]:
    from phloem.benchmarks.decode import graph_us
    from phloem.kernels.linear.w8a8 import fp8_w8a8_block_matmul_reference

    rows: list[dict[str, object]] = []
    for shape_idx, (name, (n, k)) in enumerate(SHAPES.items()):
        weight, blocks = make_weight(n, k, seed=shape_idx)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            refs = {"w8a8": fp8_w8a8_block_matmul_reference(x, weight), "weight-only": F.linear(x, weight.dense())}
            for path, (kind, fn) in paths(weight, blocks).items():
                try:
                    err = rel_err(fn(x), refs[kind])
                    us = graph_us(lambda fn=fn: fn(x), calls=1)
                except (RuntimeError, TypeError, ValueError) as exc:  # an unsupported shape or API: reported
                    rows.append({"shape": name, "tokens": m, "path": path, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    continue
                tflops = 2 * m * n * k / us / 1e6
                rows.append({"shape": name, "tokens": m, "path": path, "us": us, "tflops": tflops, "rel_err": err,
                             "flag": err > 1e-2})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| shape | tokens | path | µs | TFLOP/s | rel. error |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['path']} | — | — | {r['error']} |")
            continue
        flag = " (CHECK)" if r["flag"] else ""
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['path']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                     f"{r['rel_err']:.1e}{flag} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("w8a8_bench needs a CUDA GPU")
    rows = bench(tuple(args.tokens))
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
