"""Sending on a link from a background thread: the prefill side's KV stream leaves while it computes.

``QueuedSender`` owns one link's sends for the span of one request: ``put`` queues a message and
returns (the prefill forward calls it after each full-attention layer), one daemon thread sends
them in ``put`` order, and ``finish`` waits for the queue to drain and reports a failure::

    engine thread:  forward ─ put(KVLayer 0) ─ … layers … ─ put(KVLayer 1) ─ … ─ finish() ─ send(GDNState) …
    sender thread:                └─ send(KVLayer 0) ──────────────┘└─ send(KVLayer 1) ─┘

Order. The owner does not send on the link itself between the first ``put`` and ``finish``; so
messages leave in the order they were produced, as one thread would have sent them.

Bounded. At most ``max_queued`` messages wait (each a copy of one layer's pages): a full queue
blocks ``put``, so a slow link holds the forward back instead of piling up copies.

Failures. The first ``TransportError`` is kept; later messages are dropped without sending (the
link is dead), ``put`` never blocks on a dead link for longer than the send that failed, and
``finish`` raises the error: the caller drops the link as for a failed send of its own.

CUDA. A tensor produced on the compute stream is sent from a side stream that waits for an
event recorded at ``put`` (not for the whole forward queued after it), and is kept alive for
that stream (``record_stream``). Written for the NCCL data path; not yet run on GPUs.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import torch

from phloem.engine.transfer import KVTransport, Message, TransportError

__all__ = ["QueuedSender"]

_Item = tuple[Message, torch.cuda.Event | None]


class QueuedSender:
    """Sends ``put`` messages on ``transport`` in order from one background thread.

    Args:
        transport: The link (the owner sends nothing on it itself until ``finish``).
        timeout_s: Bound of each send.
        max_queued: Messages that may wait before ``put`` blocks.
    """

    def __init__(self, transport: KVTransport, timeout_s: float, max_queued: int = 4) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued: must be at least 1, got {max_queued}")
        self._transport = transport
        self._timeout_s = timeout_s
        self._queue: queue.Queue[_Item | None] = queue.Queue(max_queued)
        self._thread: threading.Thread | None = None
        self._error: TransportError | None = None
        self.num_sent = 0

    def put(self, message: Message) -> None:
        """Queue ``message`` (blocks while the queue is full); dropped once the link failed."""
        if self._error is not None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phloem-pd-send", daemon=True)
            self._thread.start()
        self._queue.put((message, _ready_event(message)))

    def finish(self) -> None:
        """Wait until everything queued was sent (idempotent).

        Raises:
            TransportError: a send failed (the link is dead).
        """
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Let the queued messages go out and end the thread; wait for it (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        side = None
        while (item := self._queue.get()) is not None:
            message, ready = item
            if self._error is not None:
                continue
            try:
                if ready is None:
                    self._transport.send(message, self._timeout_s)
                else:
                    # On the tensors' GPU: a new stream would otherwise go to this thread's current device.
                    device = next(t.device for t in _tensors(message) if t.is_cuda)
                    side = side if side is not None else torch.cuda.Stream(device=device)
                    _send_on(side, ready, self._transport, message, self._timeout_s)
                self.num_sent += 1
            except TransportError as exc:
                self._error = exc
            except Exception as exc:
                # Not the link's fault, but where the peer stands is unknown now: treat it as dead.
                self._error = TransportError(f"link to {self._transport.peer}: send failed: {exc!r}")


def _tensors(message: Message) -> list[torch.Tensor]:
    values = (getattr(message, f.name) for f in dataclasses.fields(message))
    return [v for v in values if isinstance(v, torch.Tensor)]


def _ready_event(message: Message) -> torch.cuda.Event | None:
    """An event on the current stream after ``message``'s CUDA tensors were produced (else None)."""
    if not any(t.is_cuda for t in _tensors(message)):
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _send_on(stream: torch.cuda.Stream, ready: torch.cuda.Event, transport: KVTransport, message: Message,
             timeout_s: float) -> None:
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for t in _tensors(message):
            if t.is_cuda:
                t.record_stream(stream)
        transport.send(message, timeout_s)
