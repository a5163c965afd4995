"""Kernel choices that are product options: one frozen value passed down to where ops are chosen.

``KernelConfig()`` is the default every engine gets: Triton kernels on a CUDA device (torch
references elsewhere), the Triton one-token GEMV and split-KV decode attention, the fused one-token
decode path, programmatic dependent launch where the GPU supports it, and the one-shot all-reduce
under tensor parallelism. ``runtime.env`` builds one from ``PHLOEM_*`` variables for the CLI;
nothing under ``kernels/`` or ``engine/`` reads the environment.
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
    interpreter).
    """

    backend: BackendChoice = "auto"
    triton_gemv: bool = True
    triton_decode_attention: bool = True
    fused_decode: bool = True
    pdl: bool | None = None
    one_shot_allreduce: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel backend must be 'auto', 'torch' or 'triton', got {self.backend!r}")
