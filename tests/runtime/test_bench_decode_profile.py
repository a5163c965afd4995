"""The step profile's arithmetic (``benchmarks.decode._step_profile``) on hand-made device events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from phloem.benchmarks.decode import _step_profile


def _event(name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_busy_time_is_the_union_of_kernel_intervals_and_rows_are_per_step() -> None:
    # Two replays of a step: gemv 0-10, norm 12-14 (overlapping a gemv tail 13-15), gemv 20-30, norm 32-34.
    events = [
        _event("gemv", 0, 10), _event("norm", 12, 14), _event("gemv", 13, 15),
        _event("gemv", 20, 30), _event("norm", 32, 34), _event("host op", 0, 50, DeviceType.CPU),
    ]  # fmt: skip
    profile = _step_profile(SimpleNamespace(events=lambda: events), "graph", steps=2, top=5)
    assert profile.source == "graph"
    assert profile.launches == pytest.approx(2.5)
    assert profile.span_us == pytest.approx(17.0)  # 0 .. 34 over two steps
    assert profile.busy_us == pytest.approx((10 + 3 + 10 + 2) / 2)
    assert profile.kernels == [("gemv", pytest.approx(11.0), 1.5), ("norm", pytest.approx(2.0), 1.0)]


def test_no_device_events_give_an_empty_profile() -> None:
    profile = _step_profile(SimpleNamespace(events=lambda: []), "eager", steps=1, top=5)
    assert profile.launches == 0 and profile.kernels == [] and profile.busy_us == profile.span_us == 0


def test_timeline_is_the_first_steps_launches_in_order() -> None:
    """One step's launches in start order, from its first launch: (kernel, start, duration)."""
    events = [
        _event("down", 110, 118), _event("gate_up", 100, 108), _event("router", 96, 99),
        _event("down", 140, 147), _event("gate_up", 130, 137), _event("router", 126, 128),
    ]  # fmt: skip
    profile = _step_profile(SimpleNamespace(events=lambda: events), "graph", steps=2, top=5)
    assert profile.timeline == [("router", 0, 3), ("gate_up", 4, 8), ("down", 14, 8)]
    assert _step_profile(SimpleNamespace(events=lambda: []), "eager", steps=1, top=5).timeline == []
