"""The device facts launch grids are sized by."""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton

__all__ = ["balanced_grid", "num_sms", "resident_programs"]


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 2 off CUDA (the interpreter: a small grid, so
    programs walk several tiles or row blocks, as on a GPU)."""
    if device.type != "cuda":
        return 2
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def balanced_grid(tiles: int, programs_per_sm: int, device: torch.device, share: int = 1) -> int:
    """Programs for ``tiles`` that each walk the same whole number of them, at most
    ``programs_per_sm`` an SM among ``share`` such grids (0: one program per tile). 3088 tiles
    over a 528-program cap is 6 each for 515 programs, not 5.8: the last wave's stragglers set a
    kernel's time."""
    if programs_per_sm == 0:
        return tiles
    cap = max(1, programs_per_sm * num_sms(device) // share)
    return triton.cdiv(tiles, triton.cdiv(tiles, cap))


def resident_programs(kernel: Any, props: Any) -> int:
    """Programs of a compiled kernel (``n_regs``, ``metadata.num_warps``, ``metadata.shared``, as the
    GPU loaded it) that fit one SM of a device with ``props`` (``torch.cuda.get_device_properties``):
    the fewest its threads, its registers (64K an SM) and its shared memory allow. A grid sized for
    more programs an SM leaves a second wave."""
    threads = 32 * kernel.metadata.num_warps
    return min(
        props.max_threads_per_multi_processor // threads,
        65536 // max(1, kernel.n_regs * threads),
        props.shared_memory_per_multiprocessor // max(1, kernel.metadata.shared),
    )
