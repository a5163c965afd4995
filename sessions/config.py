"""``SessionConfig``: the sessions layer's knobs, and ``KEEP`` (leave a field unchanged)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["KEEP", "Keep", "SessionConfig"]


class Keep:
    """The type of ``KEEP``."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final = Keep()
"""``SessionManager.update``: leave this field as it is."""


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """The sessions layer's knobs.

    Args:
        data_dir: The journal (``data_dir/sessions``) and the SQLite index live here.
        model_fingerprint: Identifies the served model (``store.model_fingerprint``).
        redis_url: Use a Redis index instead of SQLite.
        default_ttl_s: Seconds a session stays pinned after a turn when it names no TTL.
        max_ttl_s: Larger TTLs are clamped to this.
        max_num_generations: Generations in flight at most (sessions and stateless together);
            beyond it, ``Overloaded``.
        retry_after_s: The ``retry_after`` of ``Overloaded``.

    Raises:
        ValueError: A field is out of range (the message names it).
    """

    data_dir: Path
    model_fingerprint: str
    redis_url: str | None = None
    default_ttl_s: float = 300.0
    max_ttl_s: float = 86_400.0
    max_num_generations: int = 256
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.default_ttl_s <= self.max_ttl_s:
            raise ValueError(f"default_ttl_s: expected in [0, max_ttl_s={self.max_ttl_s}], "
                             f"got {self.default_ttl_s}")
        if self.max_num_generations < 1:
            raise ValueError(f"max_num_generations: expected >= 1, got {self.max_num_generations}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s: expected > 0, got {self.retry_after_s}")
