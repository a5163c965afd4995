"""Grid sizing of the kernels whose programs walk tiles (``kernels.triton._device``)."""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.triton._device import balanced_grid, num_sms

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
