"""Kernel choices that are product options: one frozen value passed down to where ops are chosen.

``KernelConfig()`` is the default every engine gets: Triton kernels on a CUDA device (torch
references elsewhere), the Triton one-token GEMV and split-KV decode attention, the fused one-token
decode path and programmatic dependent launch where the GPU supports it; every all-reduce of
tensor parallelism through NCCL (the one-shot NVLink all-reduce is opt-in until it has run on two
GPUs). ``runtime.env.kernel_config`` builds one from ``PHLOEM_*`` variables for the CLI; nothing
under ``kernels/`` or ``engine/`` reads the environment.

Where each field is used: ``backend``, ``triton_gemv``, ``fused_decode``, ``pdl`` and ``fp8_w8a8`` by
``kernels.dispatch.get_ops`` (the model's op table); ``triton_decode_attention`` and ``pdl`` by
``kernels.attention.flashinfer.FlashInferAttention`` (pure-decode steps: the split-KV Triton kernel
instead of FlashInfer's decode); ``one_shot_allreduce`` by ``engine.parallel.TPGroup.connect``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BackendChoice", "KernelConfig"]

BackendChoice = Literal["auto", "torch", "triton"]


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """``backend``: ``auto`` picks Triton on CUDA when it imports, else the torch references;
    ``triton`` elsewhere than CUDA needs ``TRITON_INTERPRET=1`` (tests).

    ``pdl``: programmatic dependent launch; ``None`` turns it on for sm_90+ GPUs (never under the
    interpreter; ``kernels/common/pdl.py``).

    ``one_shot_allreduce``: small all-reduces of tensor parallelism on GPUs through the one-shot
    NVLink kernel fused with the add + RMSNorm after it (``engine.parallel.one_shot_allreduce``), else NCCL.

    ``fp8_w8a8``: block-FP8 weights run W8A8 in prefill and batched steps (activations quantized
    per token and 128-column group, the FP8 tensor-core GEMM; grouped by expert for the MoE
    experts), as the FP8 checkpoints are published for; off: the weights dequantized to the model
    dtype and a bf16 matmul (``docs/decisions.md``).
    """

    backend: BackendChoice = "auto"
    triton_gemv: bool = True
    triton_decode_attention: bool = True
    fused_decode: bool = True
    pdl: bool | None = None
    one_shot_allreduce: bool = False
    fp8_w8a8: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel backend must be 'auto', 'torch' or 'triton', got {self.backend!r}")
