"""Tool waits between an agent's turns: a fixed pause, or a seeded heavy-tailed draw.

Real agents spend most of their time waiting on tools (a search in a second, a test suite in
minutes), so at any moment most sessions of a fleet are idle. ``lognormal:MEDIAN:SIGMA[:CAP]``
draws each wait as ``MEDIAN * exp(SIGMA * z)``, ``z ~ N(0, 1)``, capped at ``CAP`` seconds
(default: no cap). Its median is ``MEDIAN``; its quantile ``q`` is ``MEDIAN * exp(SIGMA * z_q)``:
with ``MEDIAN=2, SIGMA=1.5`` the p90 is 13.7 s, the p99 65 s (seconds mostly, sometimes
minutes). The draws are seeded per (seed, agent, branch), apart from the token ids, so every
mode of one run waits the same.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["ToolWait"]


@dataclass(frozen=True, slots=True)
class ToolWait:
    """How long an agent waits between two turns.

    Args:
        median_s: The fixed pause (``sigma == 0``), else the lognormal's median.
        sigma: The lognormal's shape (the standard deviation of ``log(wait)``); 0: fixed.
        cap_s: No wait is longer (None: no cap).

    Raises:
        ValueError: A negative median or sigma, or a cap below 0.
    """

    median_s: float = 0.0
    sigma: float = 0.0
    cap_s: float | None = None

    def __post_init__(self) -> None:
        if not (self.median_s >= 0 and self.sigma >= 0):
            raise ValueError(f"tool wait: expected median >= 0 and sigma >= 0, got {self.median_s}, {self.sigma}")
        if self.cap_s is not None and not self.cap_s >= 0:
            raise ValueError(f"tool wait: expected a cap >= 0, got {self.cap_s}")

    @classmethod
    def parse(cls, text: str) -> ToolWait:
        """``SECONDS`` (fixed) or ``lognormal:MEDIAN_S:SIGMA[:CAP_S]``.

        Raises:
            ValueError: Anything else (the message shows the accepted forms).
        """
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls(float(parts[0]))
            if parts[0] == "lognormal" and len(parts) in (3, 4):
                cap = float(parts[3]) if len(parts) == 4 else None
                return cls(float(parts[1]), float(parts[2]), cap)
        except ValueError as exc:
            if "tool wait" in str(exc):
                raise
        raise ValueError(f"tool wait: expected SECONDS or lognormal:MEDIAN_S:SIGMA[:CAP_S], got {text!r}")

    def rng(self, seed: int, agent: int, branch: int) -> random.Random:
        """The draws of one agent's branch (independent of its token ids' generator)."""
        return random.Random(f"tool-wait:{seed}:{agent}:{branch}")

    def draw(self, rng: random.Random) -> float:
        """One wait in seconds."""
        wait = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.sigma else self.median_s
        return min(wait, self.cap_s) if self.cap_s is not None else wait

    def __str__(self) -> str:
        if not self.sigma:
            return f"{self.median_s:g} s"
        cap = f", capped at {self.cap_s:g} s" if self.cap_s is not None else ""
        return f"lognormal, median {self.median_s:g} s, sigma {self.sigma:g}{cap}"
