"""One fresh torch.distributed KV link on loopback, for the transfer and disaggregation tests."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from phloem.engine.kv_transfer_dist import PrefillListener, TorchDistTransport, connect

__all__ = ["link_pair"]


@contextlib.contextmanager
def link_pair() -> Iterator[tuple[TorchDistTransport, TorchDistTransport]]:
    """``(decode end, prefill end)`` of one link; both ends and the listener close on exit."""
    listener = PrefillListener("127.0.0.1", 0, connect_timeout_s=10)
    accepted: list[TorchDistTransport | None] = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()))
    thread.start()
    decode = connect("127.0.0.1", listener.port, connect_timeout_s=10)
    thread.join(10)
    prefill = accepted[0]
    assert prefill is not None
    try:
        yield decode, prefill
    finally:
        decode.close()
        prefill.close()
        listener.close()
