"""Loopback plumbing for the transfer and disaggregation tests: one fresh torch.distributed KV
link, or a prefill worker serving a listener from a thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from phloem.engine.transfer.dist_transport import PrefillListener, TorchDistTransport, connect
from phloem.runtime.pd.prefill import PrefillWorker

__all__ = ["link_pair", "serving"]


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


@contextlib.contextmanager
def serving(worker: PrefillWorker) -> Iterator[PrefillListener]:
    """``worker`` serving a loopback listener from a thread; halted, joined and closed on exit."""
    listener = PrefillListener("127.0.0.1", 0, connect_timeout_s=10)
    halt = threading.Event()
    thread = threading.Thread(target=worker.serve_forever, args=(listener, halt), daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        halt.set()
        thread.join(10)
        listener.close()
