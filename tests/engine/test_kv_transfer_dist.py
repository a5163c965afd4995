"""The transfer messages and their torch.distributed transport (gloo), both ends in this process.

The two ends run on two threads here (a gloo group does not care); the two-process runs, and
peers that die, are in ``tests/runtime/test_pd.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from phloem.engine.transfer.protocol import (
    GDNState, Goodbye, Hello, KVLayer, PrefillDeclined, PrefillDone, PrefillProgress, PrefillRequest,
    TransferError, TransportError, join_message, split_message,
)
from phloem.engine.transfer.dist_transport import PrefillListener, TorchDistTransport, connect
from pd_links import link_pair

HELLO = Hello("decode", 16, 256, (1, 2, 16, 2, 32), "float32", (3, 192, 3), "float32", (3, 4, 16, 16))
MESSAGES = [
    HELLO,
    PrefillRequest(1, torch.arange(37, dtype=torch.int64), 16, 0.7, 0.9, 5, None, 1),
    PrefillRequest(2, torch.tensor([3], dtype=torch.int64), 0, 0.0, 1.0, 0, 2**62, 0),
    PrefillDeclined(3, 40),
    PrefillProgress(1, 32, 37),
    KVLayer(1, 0, 1, torch.randn(2, 2, 16, 2, 32)),
    KVLayer(1, 0, 0, torch.randn(3, 2, 4, 1, 8).to(torch.bfloat16)),
    KVLayer(1, 0, 0, torch.empty(0, 2, 16, 2, 32)),
    KVLayer(1, 0, 0, (torch.randn(2, 2, 4, 1, 8) * 100).to(torch.float8_e4m3fn)),  # fp8 KV pages
    GDNState(1, torch.randn(3, 192, 3), torch.randn(3, 4, 16, 16)),
    PrefillDone(1, 17, 16),
    TransferError(1, "no room ✗"),
    Goodbye(),
]


def same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__slots__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        # As bytes: torch.equal has no fp8 kernel on CPU.
        equal = (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                 if isinstance(x, torch.Tensor) and x.element_size() == 1 else
                 x.dtype == y.dtype and torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)
        if not equal:
            return False
    return True


def exchange(sender: TorchDistTransport, messages: list[object], receiver: TorchDistTransport) -> list[object]:
    """Send from a thread: a gloo send completes only once the peer posted the matching receive."""
    thread = threading.Thread(target=lambda: [sender.send(m, timeout_s=10) for m in messages])  # type: ignore[arg-type]
    thread.start()
    received = [receiver.recv(timeout_s=10) for _ in messages]
    thread.join()
    return received


@pytest.fixture
def link() -> Iterator[tuple[TorchDistTransport, TorchDistTransport]]:
    """(decode end, prefill end) of one fresh link."""
    with link_pair() as ends:
        yield ends


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_split_join_round_trip(message: object) -> None:
    assert same(join_message(*split_message(message)), message)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "fields", "num_tensors", "match"),
    [
        (99, {}, 0, "unknown kind 99"),
        (6, {"xfer_id": 1, "first_token": 2}, 0, "expects fields"),
        (6, {"xfer_id": 1, "first_token": 2, "num_cached": 0, "extra": 1}, 0, "expects fields"),
        (6, {"xfer_id": "1", "first_token": 2, "num_cached": 0}, 0, r"PrefillDone.xfer_id: expected"),
        (6, {"xfer_id": True, "first_token": 2, "num_cached": 0}, 0, r"PrefillDone.xfer_id"),
        (4, {"xfer_id": 1, "layer": 0, "first_page": 0}, 0, "1 tensor"),
        (1, dict(split_message(HELLO)[1], kv_shape=[1, "2"]), 0, r"Hello.kv_shape"),
    ],
)
def test_join_rejects_malformed_messages(kind: int, fields: dict[str, object], num_tensors: int, match: str) -> None:
    with pytest.raises(TransportError, match=match):
        join_message(kind, fields, [torch.zeros(1)] * num_tensors)


def test_every_message_crosses_the_link_in_order(link: tuple[TorchDistTransport, TorchDistTransport]) -> None:
    decode, prefill = link
    received = exchange(decode, MESSAGES, prefill)
    assert all(same(got, sent) for got, sent in zip(received, MESSAGES, strict=True))
    assert exchange(prefill, [PrefillDone(3, 4, 5)], decode) == [PrefillDone(3, 4, 5)]
    assert "link" in decode.peer and "prefill 127.0.0.1" in decode.peer


def test_a_receive_that_times_out_kills_the_link(link: tuple[TorchDistTransport, TorchDistTransport]) -> None:
    decode, _ = link
    with pytest.raises(TransportError, match="receive failed"):
        decode.recv(timeout_s=0.2)
    with pytest.raises(TransportError, match="it was closed"):
        decode.send(Goodbye(), timeout_s=1)


def test_the_peer_closing_fails_a_blocked_receive(link: tuple[TorchDistTransport, TorchDistTransport]) -> None:
    decode, prefill = link
    closer = threading.Timer(0.2, prefill.close)
    closer.start()
    with pytest.raises(TransportError, match="receive failed"):
        decode.recv(timeout_s=10)
    closer.join()


def test_a_malformed_header_is_refused(link: tuple[TorchDistTransport, TorchDistTransport]) -> None:
    decode, prefill = link
    # A hostile or confused peer: a header without the magic word, sent raw on the control group.
    work = decode._control.send([torch.tensor([1, 2, 3, 4], dtype=torch.int64)], 1, 0)
    with pytest.raises(TransportError, match="bad message header"):
        prefill.recv(timeout_s=10)
    work.wait()


@pytest.mark.slow  # waits out a connect timeout
def test_connecting_to_nobody_fails_clearly() -> None:
    listener = PrefillListener("127.0.0.1", 0, connect_timeout_s=1)
    port = listener.port
    listener.close()
    with pytest.raises(TransportError, match=f"cannot reach the prefill 127.0.0.1:{port}"):
        connect("127.0.0.1", port, connect_timeout_s=0.5)
