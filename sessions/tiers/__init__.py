"""Where a session's state lives, and what survives a restart: pins, spill tiers, durability.

Role: ``_pins.PinKeeper`` keeps a session's head pinned in the engine's prefix cache for its TTL
(the GPU tier); ``spill.Spiller`` moves idle sessions' state to host memory and disk and resumes
it, over ``_segments.SegmentTiers`` (the registry of spilled segments in the host pool and the
disk store); ``_flush`` writes what a restart would lose to disk on a graceful stop;
``_tier_moves.TierMoves`` is the manager's client-facing ``offload`` / ``prefetch``;
``store.SessionStore`` makes every acknowledged turn durable (journal + index) and recovers
sessions at start (``model_fingerprint`` keeps one model's state apart from another's).

May import: the session records (``sessions.session``: ``Session``, ``SpilledSegment``),
``sessions._events``, ``sessions.config``, ``sessions.errors``, ``sessions.text``,
``phloem.storage``, ``phloem.runtime`` and the engine's public types. Never the session core
above it (``manager``, ``generation``, ``_turns``, ...): the ``layers`` contract in pyproject.toml
checks it, counting type-only imports, and so does ``tools/check_import_cycles.py
--count-type-imports phloem.sessions``. Underscored modules are private to ``phloem.sessions``.
"""

from __future__ import annotations

from phloem.sessions.tiers._flush import FlushReport
from phloem.sessions.tiers._pins import PinKeeper
from phloem.sessions.tiers._segments import SegmentTiers
from phloem.sessions.tiers._tier_moves import TierMoves
from phloem.sessions.tiers.spill import Spiller
from phloem.sessions.tiers.store import SessionStore, model_fingerprint

__all__ = [
    "FlushReport", "PinKeeper", "SegmentTiers", "SessionStore", "Spiller", "TierMoves",
    "model_fingerprint",
]
