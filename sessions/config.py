"""``SessionConfig``: the sessions layer's knobs, and ``KEEP`` (leave a field unchanged).

It imports without torch (``phloem.sessions`` loads its names lazily), so the CLI builds it from
flags before anything heavy loads. It holds what the user chooses only: the served model's
fingerprint is measured by whoever builds the ``SessionManager`` and handed to it separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from phloem.runtime.env import default_data_dir, default_redis_prefix
from phloem.runtime.shared_prefixes import SharedPrefix

__all__ = ["KEEP", "Keep", "SessionConfig"]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


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
        data_dir: The journal (``data_dir/sessions``) and the SQLite index live here; for
            ``phloem serve`` also its models, kernel caches and secret (``$PHLOEM_DATA_DIR``,
            else ``~/.phloem``).
        redis_url: ``redis://``, ``rediss://`` or ``unix://`` URL of a Redis index to use
            instead of the embedded SQLite one.
        redis_prefix: Namespace of the Redis index's keys (``$PHLOEM_REDIS_PREFIX``, else
            ``phloem:``).
        default_ttl_s: Seconds a session stays pinned after a turn when it names no TTL.
        max_ttl_s: Larger TTLs are clamped to this.
        max_num_generations: Generations in flight at most (sessions and stateless together);
            beyond it, ``Overloaded`` (503 over HTTP).
        retry_after_s: The ``retry_after`` of ``Overloaded``; the server also sends it as the
            ``Retry-After`` of its per-key 429 answers.
        session_tiers: Spill idle sessions to host memory and disk and resume them from there.
            False (``--no-session-tiers``): nothing is ever spilled; an idle session stays in
            the prefix cache until the engine evicts it, and its next turn recomputes what was
            evicted (what stateless servers do; the benchmarks' ``tiersoff`` baseline).
        host_budget_bytes: Payload bytes of spilled state kept in host memory; beyond it the
            least recently used host segments are demoted to disk (``sessions.tiers.spill``).
            With CUDA and ``session_tiers``, this and the backlog's bytes, and a quarter more for
            disk reads in flight, are pinned at start-up (``storage.pinned_arena``: 0.3–0.6 s a
            GiB), the memory spills are copied into.
        host_backlog_bytes: Payload bytes of spilled state that may wait, beyond
            ``host_budget_bytes``, for the disk writes that make its room in host memory (the
            spill does not wait for them). With the disk that far behind, the least recently
            used host segment is dropped (its session recomputes it) rather than hold the GPU.
            An empty backlog takes any one segment. None: a quarter of ``host_budget_bytes``;
            0: no backlog (a spill into a full host pool waits for its demotion; nothing dropped).
            Size it to the spills of a burst of turns ending together beyond what the disk writes
            meanwhile (128 agents' first turns ending: ~4.7 GB waiting at ~1 GB/s of writes).
        idle_to_host_s: Seconds a session stays ``idle`` (unpinned, on the GPU) before the
            sweeper spills it to host memory. 0: spilled as its pin ends, before it is unpinned
            (never evictable without a copy: for more sessions than the GPU holds).
        sweep_interval_s: Seconds between two runs of the spill sweeper (which also probes a
            degraded index).
        admission_stall_s: Seconds a generation may wait for memory in the engine (its pools
            full after eviction) before pinned sessions that are not generating are demoted
            to make room (pins never deadlock). Waiting behind other work never demotes.
        tokenize_workers: Threads that tokenize and render inputs off the event loop (0: sized
            to the machine's CPUs; ``sessions.text._tokenize_pool``).
        max_tokenizations_per_owner: Tokenizations one owner runs at once (more wait).
        shared_prefixes: Prefixes computed and pinned at start in the prefix cache's shared
            namespace: every owner's requests may hit them (``runtime.shared_prefixes``).
        shutdown_flush_s: On a graceful shutdown, seconds spent writing to disk the state a
            restart would lose: segments in host memory, then sessions only on the GPU (most
            recently used first); what is left then resumes by recompute. 0: write nothing.

    Raises:
        ValueError: A field is out of range (the message names it).
    """

    data_dir: Path = field(default_factory=default_data_dir)
    redis_url: str | None = None
    redis_prefix: str = field(default_factory=default_redis_prefix)
    default_ttl_s: float = 300.0
    max_ttl_s: float = 86_400.0
    max_num_generations: int = 256
    retry_after_s: float = 1.0
    session_tiers: bool = True
    host_budget_bytes: int = 4 << 30
    host_backlog_bytes: int | None = None
    idle_to_host_s: float = 30.0
    sweep_interval_s: float = 1.0
    admission_stall_s: float = 1.0
    tokenize_workers: int = 0
    max_tokenizations_per_owner: int = 2
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    shutdown_flush_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, Path):
            raise ValueError(f"data_dir: expected a pathlib.Path, got {self.data_dir!r}")
        if self.redis_url is not None and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(f"redis_url: expected a URL starting with {_REDIS_SCHEMES}, got {self.redis_url!r}")
        for name in ("max_num_generations", "tokenize_workers", "max_tokenizations_per_owner"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
        if not 0 <= self.default_ttl_s <= self.max_ttl_s:
            raise ValueError(f"default_ttl_s: expected in [0, max_ttl_s={self.max_ttl_s}], "
                             f"got {self.default_ttl_s}")
        if self.max_num_generations < 1:
            raise ValueError(f"max_num_generations: expected >= 1, got {self.max_num_generations}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s: expected > 0, got {self.retry_after_s}")
        if not self.redis_prefix:
            raise ValueError(f"redis_prefix: expected a non-empty string, got {self.redis_prefix!r}")
        if self.host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes: expected >= 0, got {self.host_budget_bytes}")
        if self.host_backlog_bytes is not None and self.host_backlog_bytes < 0:
            raise ValueError(f"host_backlog_bytes: expected >= 0 or None, got {self.host_backlog_bytes}")
        for name in ("idle_to_host_s", "shutdown_flush_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected seconds >= 0, got {getattr(self, name)}")
        if self.tokenize_workers < 0 or self.max_tokenizations_per_owner < 1:
            raise ValueError(f"tokenize_workers / max_tokenizations_per_owner: expected >= 0 / >= 1, "
                             f"got {self.tokenize_workers} / {self.max_tokenizations_per_owner}")
        for name in ("sweep_interval_s", "admission_stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {getattr(self, name)}")

    @property
    def backlog_budget_bytes(self) -> int:
        """``host_backlog_bytes``, its default resolved."""
        return self.host_budget_bytes // 4 if self.host_backlog_bytes is None else self.host_backlog_bytes
