"""The index's per-session record: where a session's state lives, plus an opaque payload.

Storage does not interpret ``data``: the sessions layer owns its contents (token ids, turns,
metadata, parent, fork point) and hands it over as a JSON string. Storage only needs the fields
it indexes by (owner), the ones the placement policy reads (tier, last_used, num_tokens) and the
ones that keep resumes honest (segment_id, model_fingerprint).

Invariant: a session has a segment exactly when its state is off the GPU and kept::

    tier    'gpu'   'host'      'disk'      'none'
    segment  None   segment_id  segment_id  None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ._fs import check_id

__all__ = ["TIERS", "SessionRecord", "Tier", "check_tier"]

Tier = Literal["gpu", "host", "disk", "none"]
TIERS: tuple[str, ...] = get_args(Tier)


def check_tier(tier: object, segment_id: object) -> None:
    """Raise ``ValueError`` unless ``tier`` is valid and ``segment_id`` matches it."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    if tier in ("host", "disk"):
        check_id(segment_id, f"segment_id of a {tier!r}-tier session")
    elif segment_id is not None:
        raise ValueError(f"a {tier!r}-tier session has no segment, got segment_id={segment_id!r}")


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session as the index sees it.

    Args:
        session_id: Filesystem-safe id (1-128 characters of ``[A-Za-z0-9_-]``).
        owner: The API key (or key id) that owns the session.
        model_fingerprint: The model the session's state belongs to.
        num_tokens: Tokens in the session's history.
        last_used: Unix time of the last turn end or access.
        data: Opaque JSON of the sessions layer's record.
        tier: Where the session's KV and GDN state lives now.
        segment_id: The spilled segment, for the ``host`` and ``disk`` tiers only.

    Raises:
        ValueError: a field has the wrong type or breaks the tier/segment invariant.
    """

    session_id: str
    owner: str
    model_fingerprint: str
    num_tokens: int
    last_used: float
    data: str
    tier: Tier = "none"
    segment_id: str | None = None

    def __post_init__(self) -> None:
        check_id(self.session_id, "session_id")
        for name in ("owner", "model_fingerprint", "data"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ValueError(f"SessionRecord.{name} must be a str, got {value!r:.80}")
        n = self.num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"SessionRecord.num_tokens must be an int >= 0, got {n!r}")
        if isinstance(self.last_used, bool) or not isinstance(self.last_used, (int, float)):
            raise ValueError(f"SessionRecord.last_used must be a float, got {self.last_used!r}")
        check_tier(self.tier, self.segment_id)
