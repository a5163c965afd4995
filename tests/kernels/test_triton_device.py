"""Grid sizing of the kernels whose programs walk tiles (``kernels.common.device``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from phloem.kernels.common.device import balanced_grid, num_sms, resident_programs

CPU = torch.device("cpu")


@pytest.mark.parametrize("programs_per_sm", [1, 2, 4])
@pytest.mark.parametrize("share", [1, 3])
def test_programs_walk_equal_whole_numbers_of_tiles(programs_per_sm: int, share: int) -> None:
    cap = max(1, programs_per_sm * num_sms(CPU) // share)
    for tiles in range(1, 200):
        grid = balanced_grid(tiles, programs_per_sm, CPU, share)
        walk = -(-tiles // grid)
        assert grid <= cap and grid * walk >= tiles and (grid - 1) * walk < tiles, (tiles, grid)
        assert walk == -(-tiles // cap)  # no more tiles per program than the cap forces


def test_zero_programs_per_sm_is_one_program_per_tile() -> None:
    assert balanced_grid(3088, 0, CPU) == 3088


def test_off_cuda_the_grid_is_small() -> None:
    assert num_sms(CPU) == 2


# An H200 SM: 2048 threads, 64K registers, 228 KB of shared memory.
H200_SM = SimpleNamespace(max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472)


@pytest.mark.parametrize(
    ("regs", "warps", "shared", "fits"),
    [(136, 4, 512, 3), (128, 4, 512, 4), (64, 8, 64, 4), (44, 4, 16, 11), (16, 4, 0, 16), (32, 4, 100_000, 2)],
    ids=["gate_up-136", "gate_up-128", "gemv-64", "down-44", "threads", "shared"],
)
def test_resident_programs_is_the_tightest_of_threads_registers_and_shared(regs: int, warps: int, shared: int, fits: int) -> None:
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert resident_programs(kernel, H200_SM) == fits
