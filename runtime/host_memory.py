"""The server process's host memory: resident set and page-locked (pinned) bytes.

The host tier holds spilled session state in pinned memory (``storage.host_pool``), and pinned
memory is where host usage can exceed the tier's own accounting: torch's caching host allocator
rounds every pinned block up to a power of two and keeps freed blocks cached for reuse rather
than returning them (``PYTORCH_ALLOC_CONF``'s ``pinned_max_round_threshold_mb`` and
``pinned_max_cached_size_mb`` change that). ``phloem_host_pool_bytes`` counts the segments'
payload; ``pinned_bytes`` here is what the allocator holds for them and for every other pinned
buffer, so the two side by side (and the resident set beside both) say where host memory went.

Read at scrape time, cheaply: ``/proc/self/statm`` (Linux; None elsewhere) and the allocator's
counters (None without CUDA: there is no pinned memory then).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["ProcessMemory", "process_memory"]


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """Host memory of this process, in bytes; None where it cannot be read.

    Args:
        resident_bytes: The resident set (pages in RAM, pinned ones included).
        pinned_bytes: Pinned blocks torch's caching host allocator holds, in use or cached, at
            their rounded sizes.
        pinned_active_bytes: Of those, the blocks in use.
    """

    resident_bytes: int | None
    pinned_bytes: int | None
    pinned_active_bytes: int | None


def process_memory() -> ProcessMemory:
    """This process's host memory now."""
    pinned = active = None
    if torch.cuda.is_available():
        stats = torch.cuda.host_memory_stats()  # empty until the first pinned allocation
        pinned = int(stats.get("allocated_bytes.current", 0))
        active = int(stats.get("active_bytes.current", 0))
    return ProcessMemory(_resident_bytes(), pinned, active)


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
