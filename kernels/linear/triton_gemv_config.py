"""Launch configurations of the one-token GEMVs (``kernels.linear.triton_gemv``), by weight shape.

``gemv_config`` is what every launch uses unless a caller passes a ``GemvConfig`` itself
(``triton_gemv.linear_tuned``: the benchmark sweeps, ``benchmarks/sweeps/gemv_sweep.py``). The choices are the
sweep's winners at the Qwen3.5-35B-A3B decode shapes: 4 programs per SM walking row blocks with
the one-ahead prefetch (the prologue runs once per program, not once per block), tiles of 8 K
elements per block, 4 warps for small weights such as the router; ``docs/decisions.md`` has the
alternatives they were chosen over.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

__all__ = ["MAX_K", "GemvConfig", "gemv_config"]

# Longest row the prologue holds in registers.
MAX_K = 8192


class GemvConfig(NamedTuple):
    """Rows per tile, warps, pipeline stages, programs per SM (0: one program per row block), the
    one-block-ahead prefetch and ptxas's register cap a thread (0: none)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    prefetch: bool
    max_registers: int = 0


_WIDE = GemvConfig(block_n=4, num_warps=8, num_stages=1, programs_per_sm=4, prefetch=True)


def gemv_config(num_n: int, num_k: int, conv: bool = False, route: bool = False) -> GemvConfig:
    """The launch configuration for an ``[num_n, num_k]`` weight (``conv``: with the conv epilogue;
    ``route``: with the router's partial logits)."""
    block_n = max(1, min(8, 8192 // triton.next_power_of_2(num_k)))
    if num_n < 1024:
        return _WIDE._replace(block_n=min(block_n, 2), num_warps=4, programs_per_sm=1)
    if route:
        # Uncapped, the route epilogue's out_proj needs about 100 registers a thread: 2 programs an
        # SM for a grid sized for 4. Capped at 64 it keeps 4.
        return _WIDE._replace(block_n=block_n, max_registers=64)
    # The conv epilogue after the walk, capped at 64 registers a thread (it loads at 62-64 without
    # spills; the cap keeps the in_proj launches at their best). The other shapes need at most 64.
    return _WIDE._replace(block_n=block_n, max_registers=64 if conv else 0)
