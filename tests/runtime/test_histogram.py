"""``runtime.histogram``: Prometheus bucket semantics (a value equal to a bound counts in it)."""

from __future__ import annotations

import pytest

from phloem.runtime.histogram import STEP_SECONDS_BOUNDS, Histogram


def test_buckets_sum_and_count() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(value)
    snap = h.snapshot()
    assert snap.counts == (2, 2, 1) and snap.count == 5 and snap.total == pytest.approx(8.65)
    h.observe(0.0)
    assert snap.counts == (2, 2, 1), "a snapshot is a copy"


@pytest.mark.parametrize("bounds", [(), (1.0, 1.0), (2.0, 1.0)], ids=["empty", "equal", "descending"])
def test_bounds_must_ascend(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="strictly ascending"):
        Histogram(bounds)


def test_step_bounds_are_valid() -> None:
    assert Histogram(STEP_SECONDS_BOUNDS).snapshot().counts == (0,) * (len(STEP_SECONDS_BOUNDS) + 1)
