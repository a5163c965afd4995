"""Session state off the GPU: host pinned-memory tier, disk tier (safetensors), and the index.

Role: store and find spilled session segments (KV pages of the full-attention layers plus the GDN
head checkpoint). A leaf package: it imports nothing of ours.

The tiers that need torch, safetensors or redis (``DiskStore``, ``HostPool``, ``PinnedArena``,
``RedisIndex``, the segment types) load on first use (``__getattr__``), so ``phloem serve`` can
lock its data directory and answer a usage error before torch is imported (seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .data_dir import DataDirInUse, DataDirLock, lock_data_dir, server_secret
from .errors import (
    CorruptRecord,
    CorruptSegment,
    IndexUnavailable,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from .index import RebuildReport, SessionIndex, SQLiteIndex
from .journal import SessionJournal
from .record import TIERS, SessionRecord, Tier

if TYPE_CHECKING:
    from .disk import FORMAT_VERSION, DiskStore
    from .host_pool import HostPool
    from .pinned_arena import PinnedArena
    from .redis_index import RedisIndex
    from .segment import TENSOR_NAMES, Segment, SegmentLayout, SegmentMeta, hash_token_ids

_LAZY = {
    "FORMAT_VERSION": "disk", "DiskStore": "disk", "HostPool": "host_pool", "PinnedArena": "pinned_arena",
    "RedisIndex": "redis_index",
    "TENSOR_NAMES": "segment", "Segment": "segment", "SegmentLayout": "segment", "SegmentMeta": "segment",
    "hash_token_ids": "segment",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = [
    "FORMAT_VERSION",
    "TENSOR_NAMES",
    "TIERS",
    "CorruptRecord",
    "CorruptSegment",
    "DataDirInUse",
    "DataDirLock",
    "DiskStore",
    "HostPool",
    "IndexUnavailable",
    "PinnedArena",
    "RebuildReport",
    "RedisIndex",
    "SQLiteIndex",
    "Segment",
    "SegmentLayout",
    "SegmentMeta",
    "SessionIndex",
    "SessionJournal",
    "SessionRecord",
    "StorageError",
    "StorageFull",
    "StorageUnavailable",
    "Tier",
    "hash_token_ids",
    "lock_data_dir",
    "server_secret",
]
