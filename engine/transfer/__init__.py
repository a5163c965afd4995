"""Moving KV pages and GDN state between engines: prefix export/import and the PD transfer.

Modules (which is which)::

    prefix_export   export_prefix / import_prefix: a cached prefix off the device and back
                    (session spill and resume; ``PrefixState`` is what ``storage`` segments hold)
    protocol        prefill/decode disaggregation's typed messages, their wire split/join, and
                    ``KVTransport``, the interface a transport implements
    dist_transport  ``KVTransport`` over ``torch.distributed`` (gloo control, NCCL data on CUDA):
                    ``connect`` (decode side) and ``PrefillListener`` (prefill side)
    pool_side       the engine's pools during a PD transfer: reserve / install / release on the
                    decode side, ``transfer_source`` and ``stream_hook`` on the prefill side

Every tensor crosses in the TP=1 layout; ``engine.parallel.state_shards`` gathers and scatters
the ranks' parts. The names below are the sub-package's public API: ``runtime`` imports them from
here, never from the modules.

May import: the engine core (``phloem.engine.*``), ``engine.parallel`` (and torch).
"""

from __future__ import annotations

from phloem.engine.transfer.dist_transport import PrefillListener, TorchDistTransport, connect
from phloem.engine.transfer.pool_side import TransferReservation, TransferSource, stream_hook
from phloem.engine.transfer.prefix_export import HostAlloc, PrefixState
from phloem.engine.transfer.protocol import (
    GDNState,
    Goodbye,
    Hello,
    KVLayer,
    KVTransport,
    Message,
    PrefillDeclined,
    PrefillDone,
    PrefillProgress,
    PrefillRequest,
    TransferError,
    TransportError,
)

__all__ = [
    "GDNState", "Goodbye", "Hello", "HostAlloc", "KVLayer", "KVTransport", "Message", "PrefillDeclined",
    "PrefillDone", "PrefillListener", "PrefillProgress", "PrefillRequest", "PrefixState", "TorchDistTransport",
    "TransferError", "TransferReservation", "TransferSource", "TransportError", "connect", "stream_hook",
]
