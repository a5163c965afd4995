"""The prefill side streams KV layer by layer while its last prefill step's forward runs.

A real ``PrefillWorker`` serves on a thread; this thread plays the decode side on a real gloo link.
The worker's model is the real tiny model (8 layers: full attention at 3 and 7); a forward
pre-hook on its last layer (7) *waits* in the last prefill step until this side has received
``KVLayer(layer=0)``. With KV sent only after the forward, that wait would time out: so the
test proves layer 0 crossed the link while the forward still had layers to run. The streamed
KV, GDN state and first token equal a colocated engine's exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from phloem.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from phloem.engine.transfer.protocol import (
    GDNState, KVLayer, KVTransport, Message, PrefillDone, PrefillProgress, PrefillRequest, TransportError,
)
from phloem.engine.transfer.dist_transport import connect
from phloem.runtime.pd.link import exchange_hello, hello_for
from phloem.runtime.pd.prefill import PrefillWorker
from phloem.runtime.pd.roles import PDConfig
from phloem.runtime.pd.sender import QueuedSender
from pd_links import link_pair, serving

ARCH = "Qwen3_5MoeForCausalLM"
CONFIG = EngineConfig(
    cache=CacheConfig(num_pages=128, num_state_slots=24, page_size=16, checkpoint_interval=0),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
WAIT_S = 10.0


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 256 for i in range(n)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(ARCH, num_layers=8)


class Timeline:
    """Events of both threads in the order they happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.prompt_len = 0
        self.layer0_received = threading.Event()
        self._lock = threading.Lock()

    def add(self, what: str, value: int = -1) -> None:
        with self._lock:
            self.events.append((what, value))


@pytest.fixture
def served(model: Path) -> Iterator[tuple[PrefillWorker, KVTransport, Engine, Timeline]]:
    """(prefill worker on a thread, the decode end of its link, a colocated reference, timeline)."""
    worker = PrefillWorker(Engine.from_pretrained(model, CONFIG), PDConfig(role="prefill", peer="127.0.0.1:0"))
    timeline = Timeline()
    layers = worker.engine.runner.model.model.layers  # type: ignore[attr-defined]
    assert [i for i, layer in enumerate(layers) if layer.is_full_attention] == [3, 7]

    def before_last_layer(_: Any, args: tuple[Any, ...]) -> None:
        if int(args[2].seq_lens.max()) != timeline.prompt_len:
            return  # not the request's last prefill step
        timeline.add("last-layer-start")
        timeline.add("layer0-waited", int(timeline.layer0_received.wait(WAIT_S)))

    layers[-1].register_forward_pre_hook(before_last_layer)
    layers[-1].register_forward_hook(lambda *_: timeline.add("last-layer-done"))
    ref = Engine.from_pretrained(model, CONFIG)
    with serving(worker) as listener:
        link = connect("127.0.0.1", listener.port, connect_timeout_s=10)
        exchange_hello(link, hello_for(ref, "decode"), first=True, timeout_s=10)
        try:
            yield worker, link, ref, timeline
        finally:
            link.close()


def transfer(link: KVTransport, timeline: Timeline, xfer_id: int, prompt: list[int], held_len: int) -> list[Message]:
    timeline.layer0_received.clear()
    timeline.prompt_len = len(prompt)
    link.send(PrefillRequest(xfer_id, torch.tensor(prompt), held_len, 0.0, 1.0, 0, None, 0), 10)
    received: list[Message] = []
    while not received or not isinstance(received[-1], PrefillDone):
        message = link.recv(WAIT_S * 2)
        received.append(message)
        if isinstance(message, KVLayer):
            timeline.add("kv-received", message.layer)
            if message.layer == 0:
                timeline.layer0_received.set()
    return received


def colocated(ref: Engine, prompt: list[int], first_page: int) -> tuple[list[torch.Tensor], GDNState, int]:
    rid = ref.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True, sample_first=True)
    first = -1
    while ref.has_unfinished_requests():
        first = next((o.token_ids[0] for o in ref.step() if o.request_id == rid and o.finished), first)
    source = ref.transfer_source(prompt, first_page)
    assert source is not None
    conv, ssm = source.state()
    return list(source.whole()[0][:2]), GDNState(0, conv, ssm), first


@pytest.mark.parametrize(("prompt_len", "held_len"), [(30, 0), (100, 0), (150, 40)],
                         ids=["one-step", "four-chunks", "held-prefix"])
def test_kv_streams_during_the_last_forward_and_equals_a_colocated_run(
    served: tuple[PrefillWorker, KVTransport, Engine, Timeline], prompt_len: int, held_len: int
) -> None:
    worker, link, ref, timeline = served
    prompt = tokens(prompt_len, 5)
    received = transfer(link, timeline, 1, prompt, held_len)

    kinds = [type(m).__name__ for m in received if not isinstance(m, PrefillProgress)]
    assert kinds == ["KVLayer", "KVLayer", "GDNState", "PrefillDone"]
    assert all(isinstance(m, PrefillProgress) for m in received[: len(received) - 4])
    assert [m.layer for m in received if isinstance(m, KVLayer)] == [0, 1]
    # Layer 0 arrived while layer 7 (the last) waited to start: before the forward finished.
    events = timeline.events
    last_done = len(events) - 1 - events[::-1].index(("last-layer-done", -1))
    assert events.index(("kv-received", 0)) < events.index(("layer0-waited", 1)) < last_done
    assert events.index(("kv-received", 1)) > last_done  # layer 1 is layer 7 itself
    assert events.count(("last-layer-start", -1)) == 1

    first_page = held_len // 16
    kv, state, first = colocated(ref, prompt, first_page)
    streamed = [m for m in received if isinstance(m, KVLayer)]
    assert all(m.first_page == first_page and torch.equal(m.kv, kv[m.layer]) for m in streamed)
    got_state = next(m for m in received if isinstance(m, GDNState))
    assert torch.equal(got_state.conv, state.conv) and torch.equal(got_state.ssm, state.ssm)
    done = received[-1]
    assert isinstance(done, PrefillDone) and done.first_token == first
    assert worker.num_served == 1 and worker.engine.runner.layer_hook is None
    # The worker waits for the next request now; nothing is locked on its side.
    engine = worker.engine
    assert not engine.has_unfinished_requests()
    engine.cache.tree.clear()
    assert (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots) == (
        engine.page_pool.num_pages, engine.slot_pool.num_slots)


@pytest.fixture
def bare_link() -> Iterator[tuple[KVTransport, KVTransport]]:
    """(decode end, prefill end) of one fresh link, no engines."""
    with link_pair() as ends:
        yield ends


def test_queued_sender_keeps_order_bounds_its_queue_and_reports_a_failure(
    bare_link: tuple[KVTransport, KVTransport],
) -> None:
    decode, prefill = bare_link
    messages = [KVLayer(1, i, 0, torch.full((1, 2, 4, 1, 8), float(i))) for i in range(8)]
    received: list[Message] = []
    reader = threading.Thread(target=lambda: received.extend(decode.recv(10) for _ in messages))
    reader.start()
    sender = QueuedSender(prefill, timeout_s=10, max_queued=2)
    for message in messages:
        sender.put(message)  # eight through a queue of two: put waits for room, never deadlocks
    sender.finish()
    reader.join(10)
    assert [(m.layer, float(m.kv[0, 0, 0, 0, 0])) for m in received] == [(i, float(i)) for i in range(8)]
    assert sender.num_sent == 8

    failing = QueuedSender(prefill, timeout_s=10)
    prefill.close()
    for message in messages:
        failing.put(message)  # the first send fails; the rest are dropped, put does not block
    with pytest.raises(TransportError, match="it was closed"):
        failing.finish()
    assert failing.num_sent == 0
    with pytest.raises(ValueError, match="max_queued"):
        QueuedSender(prefill, timeout_s=1, max_queued=0)
