"""Pearson's chi-square goodness-of-fit test without scipy (not a dependency of the tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["chi_square_p_value"]


def chi_square_p_value(observed: Sequence[float], expected: Sequence[float]) -> float:
    """P(X >= statistic) for X ~ chi-square with ``len(observed) - 1`` degrees of freedom; the
    counts' totals must agree (scale ``expected`` first)."""
    obs = torch.tensor(list(observed), dtype=torch.float64)
    exp = torch.tensor(list(expected), dtype=torch.float64)
    assert abs(float(obs.sum() - exp.sum())) <= 1e-6 * float(exp.sum()), "observed and expected totals differ"
    statistic = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((len(obs) - 1) / 2, dtype=torch.float64)
    # The chi-square survival function is the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(dof, statistic / 2))
