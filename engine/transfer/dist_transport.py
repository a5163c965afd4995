"""``KVTransport`` over ``torch.distributed``: a two-rank process group per link.

Rendezvous. The prefill instance is the ``TCPStore`` master at the peer address
(``PrefillListener``); a decode instance connects as a store client (``connect``), takes the next
link number with ``store.add`` and both join a fresh two-rank group under that number's key
prefix (rank 0 decode, rank 1 prefill). A broken link is never repaired: the decode side connects
again and gets a new number, and the listener, which polls the counter, joins the newest one. One
decode instance per prefill instance (the counter does not arbitrate between several).

Wire form of one message (``protocol.split_message``)::

    control group  int64[4]  [MAGIC, kind, meta_len, num_tensors]
                   uint8[meta_len]  JSON {"fields": {...}, "tensors": [[dtype, shape], ...]}
    data group     uint8[nbytes] per tensor, in order (raw bytes: any dtype, no reduction)

Control always travels over gloo (CPU tensors). On CPU the data shares that group; on CUDA the
tensors travel over a second, NCCL group between the two GPUs (``data_device``). Point-to-point
order within a group is the send order, so no tags are needed. NCCL's settings are the process
environment's: the runtime sets its defaults (``runtime.env.use_nccl_defaults``); this module
reads and writes none.

Timeouts: gloo's group timeout bounds joining (``connect_timeout_s``); every wait passes its own
bound. A wait that times out or sees the peer gone raises ``TransportError`` and the link is dead
(a timed-out gloo receive leaves the group in an undefined state).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from phloem.engine.transfer.protocol import KVTransport, Message, TransportError, join_message, split_message

__all__ = ["PrefillListener", "TorchDistTransport", "connect"]

logger = logging.getLogger(__name__)

_MAGIC = 0x50484C4F454D  # "PHLOEM"
_PREFIX = "phloem-pd"
_LINK_KEY = f"{_PREFIX}/links"
_MAX_META_BYTES = 1 << 20
_MAX_TENSORS = 8
_MAX_TENSOR_BYTES = 1 << 40
_IDLE = timedelta(days=365)
_DTYPES = {str(t).removeprefix("torch."): t
           for t in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int64)}


class TorchDistTransport(KVTransport):
    """One link: a control group (gloo) and a data group (the same one on CPU, NCCL on CUDA).

    Args:
        control: The gloo process group of the link (two ranks).
        data: The group the tensors travel on.
        rank: This side's rank (0 decode, 1 prefill).
        data_device: Where tensors are sent from and received into.
        peer: Describes the other end in messages.
        keepalive: Objects the groups need alive (the store).
    """

    def __init__(
        self, control: Any, data: Any, rank: int, data_device: torch.device, peer: str, keepalive: Any = None
    ) -> None:
        self._control: Any = control
        self._data: Any = data
        self._peer_rank = 1 - rank
        self._device = data_device
        self._peer = peer
        self._keepalive = keepalive

    @property
    def peer(self) -> str:
        return self._peer

    def send(self, message: Message, timeout_s: float) -> None:
        kind, fields, tensors = split_message(message)
        payloads = [t.detach().to(self._device).contiguous().view(-1).view(torch.uint8) for t in tensors]
        specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
        meta = json.dumps({"fields": fields, "tensors": specs}).encode()
        header = torch.tensor([_MAGIC, kind, len(meta), len(tensors)], dtype=torch.int64)
        limit = timedelta(seconds=timeout_s)
        self._p2p(self._control, "send", header, limit)
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        self._p2p(self._control, "send", meta_t, limit)
        for payload in payloads:
            if payload.numel():
                self._p2p(self._data, "send", payload, limit)

    def recv(self, timeout_s: float | None) -> Message:
        limit = _IDLE if timeout_s is None else timedelta(seconds=timeout_s)
        header = torch.empty(4, dtype=torch.int64)
        self._p2p(self._control, "recv", header, limit)
        magic, kind, meta_len, num_tensors = header.tolist()
        if magic != _MAGIC or not 0 < meta_len <= _MAX_META_BYTES or not 0 <= num_tensors <= _MAX_TENSORS:
            self._fail(f"bad message header {header.tolist()}")
        # Once a message started, its parts follow at once: bound them by the message timeout.
        limit = min(limit, timedelta(seconds=600)) if timeout_s is None else limit
        meta_t = torch.empty(meta_len, dtype=torch.uint8)
        self._p2p(self._control, "recv", meta_t, limit)
        try:
            meta = json.loads(bytes(meta_t.tolist()))
            specs = [(_DTYPES[d], [int(n) for n in shape]) for d, shape in meta["tensors"]]
            fields = meta["fields"]
        except (ValueError, KeyError, TypeError) as exc:
            self._fail(f"bad message metadata ({exc!r})")
        if len(specs) != num_tensors:
            self._fail(f"bad message: header says {num_tensors} tensor(s), metadata {len(specs)}")
        tensors = [self._recv_tensor(dtype, shape, limit) for dtype, shape in specs]
        try:
            return join_message(kind, fields, tensors)
        except TransportError:
            self.close()
            raise

    def _recv_tensor(self, dtype: torch.dtype, shape: list[int], limit: timedelta) -> torch.Tensor:
        if len(shape) > 8 or any(n < 0 for n in shape):
            self._fail(f"bad tensor shape {shape}")
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > _MAX_TENSOR_BYTES:
            self._fail(f"tensor of {nbytes} bytes exceeds the {_MAX_TENSOR_BYTES}-byte limit")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        if nbytes:
            self._p2p(self._data, "recv", buf, limit)
        return buf.view(dtype).view(shape)

    def close(self) -> None:
        # Dropping the last reference destroys the groups, which closes their sockets.
        self._control = self._data = self._keepalive = None

    def _group(self, group: Any) -> Any:
        if group is None:
            raise TransportError(f"link to {self._peer}: it was closed")
        return group

    def _p2p(self, group: Any, op: str, tensor: torch.Tensor, limit: timedelta) -> None:
        """One point-to-point ``send`` or ``recv`` with the peer, waited for at most ``limit``."""
        pg = self._group(group)
        try:
            # Posting the operation can fail too (a pair the peer already closed).
            work = pg.send([tensor], self._peer_rank, 0) if op == "send" else pg.recv([tensor], self._peer_rank, 0)
            work.wait(limit)
        except RuntimeError as exc:
            self.close()
            what = "send" if op == "send" else "receive"
            raise TransportError(f"link to {self._peer}: {what} failed: {_first_line(exc)}") from exc

    def _fail(self, what: str) -> NoReturn:
        self.close()
        raise TransportError(f"link to {self._peer}: {what}")



def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _join(store: Any, link: int, rank: int, device: torch.device, timeout: timedelta, peer: str) -> TorchDistTransport:
    """Form link ``link``'s groups as ``rank`` (blocks until the peer joins or ``timeout``)."""
    try:
        prefixed = dist.PrefixStore(f"{_PREFIX}/{link}", store)  # type: ignore[attr-defined]
        control = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)  # type: ignore[attr-defined]
        data = control
        if device.type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL")
            options = nccl.Options()
            options._timeout = timeout
            data = nccl(dist.PrefixStore(f"{_PREFIX}/{link}/nccl", store), rank, 2, options)  # type: ignore[attr-defined]
    except RuntimeError as exc:
        raise TransportError(f"link {link} to {peer}: joining failed: {_first_line(exc)}") from exc
    return TorchDistTransport(control, data, rank, device, f"{peer} (link {link})", keepalive=store)


def connect(host: str, port: int, connect_timeout_s: float, device: torch.device | str = "cpu") -> TorchDistTransport:
    """Open a link to the prefill instance listening at ``host:port`` (the decode side, rank 0).

    Raises:
        TransportError: it cannot be reached, or did not join within ``connect_timeout_s``.
    """
    timeout = timedelta(seconds=connect_timeout_s)
    peer = f"prefill {host}:{port}"
    try:
        store = dist.TCPStore(host, port, None, False, timeout)  # type: ignore[attr-defined]
        link = int(store.add(_LINK_KEY, 1))
    except (RuntimeError, ValueError) as exc:
        raise TransportError(f"cannot reach the {peer}: {_first_line(exc)}") from exc
    return _join(store, link, 0, torch.device(device), timeout, peer)


class PrefillListener:
    """The prefill side's rendezvous: a ``TCPStore`` master at ``host:port`` (0: a free port).

    Args:
        host: Address to bind.
        port: TCP port; 0 picks a free one (read ``port``).
        connect_timeout_s: How long joining a link may take once a decode instance asked.
        device: Where received and sent tensors live (``cuda:N``: NCCL for the data).

    Raises:
        TransportError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int, connect_timeout_s: float, device: torch.device | str = "cpu") -> None:
        self._timeout = timedelta(seconds=connect_timeout_s)
        self._device = torch.device(device)
        try:
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, None, True, self._timeout, wait_for_workers=False
            )
        except RuntimeError as exc:
            raise TransportError(f"cannot listen on {host}:{port}: {_first_line(exc)}") from exc
        self.host = host
        self.port = int(self._store.port)
        # Links asked for before this listener existed are stale.
        self._last = int(self._store.add(_LINK_KEY, 0))

    def accept(self, stop: threading.Event | None = None, poll_s: float = 0.05) -> TorchDistTransport | None:
        """Wait for a decode instance and join its link; None once ``stop`` is set.

        A link whose decode side vanished before joining is skipped (logged), and waiting goes on.
        """
        while stop is None or not stop.is_set():
            link = int(self._store.add(_LINK_KEY, 0))
            if link > self._last:
                self._last = link
                try:
                    return _join(self._store, link, 1, self._device, self._timeout, "decode")
                except TransportError as exc:
                    logger.warning("prefill listener: %s", exc)
                    continue
            time.sleep(poll_s)
        return None

    def close(self) -> None:
        """Stop listening (a decode instance can no longer connect)."""
        self._store = None
