"""Small host values on the device without waiting for the device.

``torch.tensor(values, device="cuda")`` (and indexing a CUDA tensor with a Python list) copies
synchronously: the host waits until everything already queued on the stream has run. With async
scheduling a whole decode step is queued behind the current one, so such a copy in the launch
path would stall the host for a step and undo the overlap. ``to_device`` stages a host tensor
in pinned memory and queues the copy; torch's pinned allocator keeps the block until the copy has
run, so the next call cannot overwrite it early.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``, queued rather than waited for on CUDA (pinned first)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
