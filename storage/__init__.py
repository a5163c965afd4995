"""Session state off the GPU: host pinned-memory tier, disk tier (safetensors), and the index.

Role: store and find spilled session segments (KV pages of the full-attention layers plus the GDN
head checkpoint). A leaf package: it imports nothing of ours.
"""

from __future__ import annotations

from .data_dir import DataDirInUse, DataDirLock, lock_data_dir, server_secret
from .disk import FORMAT_VERSION, DiskStore
from .errors import (
    CorruptRecord,
    CorruptSegment,
    IndexUnavailable,
    StorageError,
    StorageFull,
    StorageUnavailable,
)
from .host_pool import HostPool
from .index import RebuildReport, SessionIndex, SQLiteIndex
from .journal import SessionJournal
from .record import TIERS, SessionRecord, Tier
from .redis_index import RedisIndex
from .segment import TENSOR_NAMES, Segment, SegmentLayout, SegmentMeta, hash_token_ids

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
