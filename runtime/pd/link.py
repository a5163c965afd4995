"""The decode side's link to its prefill instance: connect, say hello, run one transfer.

``DecodeLink`` is used from one thread only (the decode client's transfer thread): it connects
lazily, checks the peer's cache layout (``Hello``), and for each request sends a
``PrefillRequest`` and collects the answer into host (or device) tensors, validating every
message against the reservation it is for::

    send PrefillRequest ─▶ { Progress* , KVLayer × attn_layers , GDNState } ─▶ PrefillDone
                                         any order between the three kinds; Done last
                       └─▶ PrefillDeclined (nothing else): raise Declined, prefill locally

It never touches the engine: the caller installs the result (or releases the reservation) on
the engine thread. A ``TransferError`` from the peer fails that request only; anything else
(peer gone, timeout, a message that breaks the protocol) also drops the link, and the next
request connects again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phloem.engine import Engine, EngineError, SamplingParams
from phloem.engine.transfer import (
    GDNState, Goodbye, Hello, KVLayer, KVTransport, Message, PrefillDeclined, PrefillDone, PrefillProgress,
    PrefillRequest, TransferError, TransferReservation, TransportError,
)
from phloem.runtime.pd.roles import PDConfig

__all__ = ["DecodeLink", "Declined", "TransferFailed", "TransferResult", "exchange_hello", "hello_for"]

logger = logging.getLogger(__name__)


class TransferFailed(EngineError):
    """One disaggregated prefill failed; ``link_lost`` says whether the link went down with it."""

    def __init__(self, message: str, link_lost: bool) -> None:
        super().__init__(message)
        self.link_lost = link_lost


class Declined(TransferFailed):
    """The prefill side declined (``PrefillDeclined``): the decode side is the cheaper side; the
    link stays up and the request is prefilled locally (not counted as a failure)."""

    def __init__(self, num_cached: int) -> None:
        super().__init__(f"the prefill instance holds only {num_cached} tokens of the prompt", link_lost=False)
        self.num_cached = num_cached


@dataclass(frozen=True, slots=True)
class TransferResult:
    kv: torch.Tensor  # [attn_layers, reserved pages, 2, page_size, kv_heads, head_dim]
    conv: torch.Tensor
    ssm: torch.Tensor
    first_token: int
    num_cached: int  # prompt tokens the prefill side took from its own cache


def hello_for(engine: Engine, role: str) -> Hello:
    """This engine's cache layout, as the peer must see it: the TP=1 layout (what crosses the link,
    whatever either side's tensor-parallel size)."""
    caches = engine.runner.caches
    kv, conv, ssm = engine.runner.state_shapes(1)
    return Hello(
        role=role,
        page_size=engine.page_pool.page_size,
        vocab_size=engine.model_config.vocab_size,
        kv_shape=(kv[0], *kv[2:]),
        kv_dtype=str(caches.kv.dtype).removeprefix("torch."),
        conv_shape=tuple(conv),
        conv_dtype=str(caches.conv.dtype).removeprefix("torch."),
        ssm_shape=tuple(ssm),
    )


def exchange_hello(transport: KVTransport, mine: Hello, first: bool, timeout_s: float) -> Hello:
    """Send ours and receive theirs (``first``: send before receiving); check both layouts agree.

    Raises:
        TransportError: the peer's first message is not a ``Hello``, or the layouts differ (the
            link is closed then).
    """
    if first:
        transport.send(mine, timeout_s)
    theirs = transport.recv(timeout_s)
    if not first:
        transport.send(mine, timeout_s)
    if not isinstance(theirs, Hello):
        transport.close()
        raise TransportError(f"link to {transport.peer}: expected Hello first, got {type(theirs).__name__}")
    if theirs.layout() != mine.layout():
        transport.close()
        raise TransportError(
            f"link to {transport.peer}: the two instances do not serve the same model layout (same "
            f"checkpoint, dtype and page size on both sides): ours {mine}, theirs {theirs}"
        )
    return theirs


class DecodeLink:
    """Connection and protocol of the decode side (one thread; one transfer at a time).

    Args:
        config: The instance's disaggregation settings.
        hello: This engine's layout (``hello_for(engine, "decode")``).
        connector: Opens a new link to the prefill instance (raises ``TransportError``).
    """

    def __init__(self, config: PDConfig, hello: Hello, connector: Callable[[], KVTransport]) -> None:
        self._config = config
        self._hello = hello
        self._connector = connector
        self._transport: KVTransport | None = None
        self._retry_at = 0.0
        self._xfer_ids = itertools.count(1)

    def transfer(self, res: TransferReservation, params: SamplingParams) -> TransferResult:
        """Have the prefill instance compute ``res``'s prompt; return what to install.

        Raises:
            Declined: the prefill side declined (the decode side is the cheaper side to prefill on).
            TransferFailed: the peer could not be reached, refused, or the link broke.
        """
        transport = self._connected()
        xfer_id = next(self._xfer_ids)
        request = PrefillRequest(
            xfer_id, torch.tensor(res.token_ids, dtype=torch.int64), res.held_len, params.temperature, params.top_p,
            params.top_k, params.seed, int(self._config.local_prefill_tokens > 0), res.namespace,
        )
        try:
            transport.send(request, self._config.timeout_s)
            return self._collect(transport, xfer_id, res)
        except TransportError as exc:
            self._drop()
            raise TransferFailed(str(exc), link_lost=True) from exc
        except TransferFailed:
            raise  # the link was dropped already if the failure broke the protocol
        except BaseException:
            self._drop()  # where the peer is in the protocol is unknown now
            raise

    def close(self) -> None:
        """Say goodbye and drop the link (idempotent)."""
        if self._transport is not None:
            try:
                self._transport.send(Goodbye(), min(self._config.timeout_s, 2.0))
            except TransportError:
                pass  # the peer is gone already: nothing to tell it
            self._drop()

    def _connected(self) -> KVTransport:
        if self._transport is not None:
            return self._transport
        now = time.monotonic()
        if now < self._retry_at:
            raise TransferFailed(
                f"the prefill instance at {self._config.peer} was unreachable; next attempt in "
                f"{self._retry_at - now:.1f} s", link_lost=True,
            )
        try:
            transport = self._connector()
            exchange_hello(transport, self._hello, first=True, timeout_s=self._config.connect_timeout_s)
        except TransportError as exc:
            self._retry_at = time.monotonic() + self._config.reconnect_interval_s
            raise TransferFailed(f"cannot link to the prefill instance at {self._config.peer}: {exc}", True) from exc
        logger.info("linked to %s", transport.peer)
        self._transport = transport
        return transport

    def _drop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def _collect(self, transport: KVTransport, xfer_id: int, res: TransferReservation) -> TransferResult:
        num_layers = self._hello.kv_shape[0]
        layers: list[torch.Tensor | None] = [None] * num_layers
        state: GDNState | None = None
        page_shape = (len(res.pages), *self._hello.kv_shape[1:])
        while True:
            message = transport.recv(self._config.timeout_s)
            if getattr(message, "xfer_id", None) != xfer_id:
                raise self._violation(transport, f"a message for another transfer: {_describe(message)}")
            match message:
                case PrefillProgress():
                    continue
                case PrefillDeclined(num_cached=num_cached):
                    if any(t is not None for t in layers) or state is not None:
                        raise self._violation(transport, f"{_describe(message)} after the transfer started")
                    raise Declined(num_cached)
                case TransferError(message=text):
                    raise TransferFailed(f"the prefill instance failed the request: {text}", link_lost=False)
                case KVLayer(layer=layer, first_page=first_page, kv=kv):
                    ok = 0 <= layer < num_layers and layers[layer] is None and first_page == res.first_page
                    if not ok or tuple(kv.shape) != page_shape or str(kv.dtype) != f"torch.{self._hello.kv_dtype}":
                        expected = f"expected pages {page_shape} from {res.first_page}"
                        raise self._violation(transport, f"unexpected {_describe(message)}; {expected}")
                    layers[layer] = kv
                case GDNState(conv=conv, ssm=ssm):
                    if state is not None or tuple(conv.shape) != self._hello.conv_shape or (
                            tuple(ssm.shape) != self._hello.ssm_shape):
                        raise self._violation(transport, f"unexpected {_describe(message)}")
                    state = message
                case PrefillDone(first_token=token, num_cached=num_cached):
                    complete = state is not None and all(t is not None for t in layers)
                    if not complete or not 0 <= token < self._hello.vocab_size:
                        raise self._violation(transport, f"{_describe(message)} before the whole state came")
                    assert state is not None
                    kv = torch.stack([t for t in layers if t is not None])
                    return TransferResult(kv, state.conv, state.ssm, token, num_cached)
                case _:
                    raise self._violation(transport, f"unexpected {_describe(message)}")

    def _violation(self, transport: KVTransport, what: str) -> TransferFailed:
        self._drop()
        return TransferFailed(f"link to {transport.peer}: protocol error: {what}; link dropped", link_lost=True)


def _describe(message: Message) -> str:
    fields = ((f.name, getattr(message, f.name)) for f in dataclasses.fields(message))
    shown = ", ".join(f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v!r:.40}" for k, v in fields)
    return f"{type(message).__name__}({shown})"
