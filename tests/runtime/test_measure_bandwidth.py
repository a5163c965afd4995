"""The copy bandwidth the decode roofline divides by (``benchmarks.decode.measure_bandwidth``)."""

from __future__ import annotations

import pytest
import torch

from phloem.benchmarks.decode import measure_bandwidth


def test_both_timers_give_a_positive_rate_on_cpu() -> None:
    cpu = torch.device("cpu")
    for timer in ("device", "host"):  # on a CPU the device timer falls back to the host's clock
        assert measure_bandwidth(cpu, nbytes=1 << 20, repeats=3, timer=timer) > 0


def test_an_unknown_timer_is_an_error() -> None:
    with pytest.raises(ValueError, match="timer must be"):
        measure_bandwidth(torch.device("cpu"), nbytes=1 << 10, repeats=1, timer="wall")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_timing_leaves_out_the_hosts_share() -> None:
    """Events time the copy alone; the host's clock adds the launch and its own wake-up, so the
    device-timed rate is not below the host-timed one (2% of slack for the run-to-run spread), and
    neither exceeds what an H200-class part could do (5 TB/s of reads plus writes)."""
    gpu = torch.device("cuda")
    device = measure_bandwidth(gpu, nbytes=1 << 30)
    host = measure_bandwidth(gpu, nbytes=1 << 30, timer="host")
    assert 0.98 * host <= device < 6e12, (device, host)
