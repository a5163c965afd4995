"""The prefill instance: computes prompts for its decode instance and streams their state back.

``PrefillWorker`` owns an ``Engine`` (no engine loop: it is the only user, one request at a time)
and serves one link at a time::

    accept link ─▶ Hello ⇄ Hello ─▶ loop: PrefillRequest ─▶ [PrefillDeclined, see below]
      ─▶ prefill-only request (samples the
      first token; its own radix cache supplies what it already holds) ─▶ PrefillProgress after
      each step but the last ─▶ KVLayer per full-attention layer, streamed during the last step
      ─▶ GDNState ─▶ PrefillDone
    Goodbye or a broken link ─▶ accept the next link

KV streams while the last prefill step's forward runs: a ``ModelRunner.layer_hook``
(``engine.transfer.pool_side.stream_hook``) copies layer ``l``'s pages right after that layer's
forward and a ``QueuedSender`` thread sends them while layer ``l + 1`` onwards compute. Earlier
chunks' pages travel with their layer in that step too (one ``KVLayer`` per layer); the
GDN state and the first token exist only once the step is over. Only the pages the decode side
does not hold are sent (from page ``held_len // page_size`` on). When the decode side holds more
than this cache, this side recomputes the difference from its own deepest checkpoint (no reverse
transfer) — unless that is the dearer side: ``declines`` answers ``PrefillDeclined`` when the
tokens this side would recompute although the decode side holds them outnumber the tokens the
decode side has left to compute, and the decode side allows it (``may_decline``: it prefills
locally at all). Why: after a failed transfer the decode side may hold a long conversation this
side lacks, and recomputing all of it here costs far more than the few new tokens there.

Failures: a request the engine refuses or that fails in a step is aborted (its pages and slot
freed) and answered with ``TransferError``, and the link stays up. A broken link (the decode side
died, timed out, or sent something malformed) aborts the request in flight, drops the link and
goes back to accepting. What a finished prefill published stays in the radix cache as any cached
prefix does (evictable; nothing stays locked).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch

from phloem.engine import CapacityExceeded, Engine, EngineConfig, EngineError, InvalidRequest, SamplingParams
from phloem.engine.transfer import (
    GDNState, Goodbye, KVLayer, KVTransport, PrefillDeclined, PrefillDone, PrefillListener, PrefillProgress,
    PrefillRequest, TransferError, TransportError, stream_hook,
)
from phloem.runtime.env import use_nccl_defaults
from phloem.runtime.pd.link import exchange_hello, hello_for
from phloem.runtime.pd.roles import PDConfig
from phloem.runtime.pd.sender import QueuedSender

__all__ = ["PrefillWorker", "declines", "run_prefill_worker"]

_STOP_GRACE_S = 5.0  # how long a stopping prefill instance waits for its worker thread

logger = logging.getLogger(__name__)


def declines(num_tokens: int, held_len: int, num_cached: int) -> bool:
    """Whether the prefill side should leave a prompt of ``num_tokens`` to the decode side, which
    holds ``held_len`` of it, when this side holds ``num_cached``: this side would recompute
    ``held_len - num_cached`` tokens the decode side already has, the decode side would compute
    ``num_tokens - held_len``; decline when the first is larger (the decode side then does at most
    half of the work this side would). A later turn of a conversation both sides followed is never
    declined: its waste is the previous turn's output tokens, its local work those plus the new
    ones."""
    return held_len - num_cached > num_tokens - held_len


class _Refused(Exception):
    """The request cannot be served (bad input, no room, a failed step): answer TransferError."""


class PrefillWorker:
    """Serves disaggregated prefills on ``engine`` for one decode instance at a time.

    Args:
        engine: This instance's engine (prefix cache on; any tensor-parallel size); the worker is its
            only user.
        config: Disaggregation settings (``timeout_s`` bounds each send).

    Raises:
        ValueError: the engine runs without a prefix cache.
    """

    def __init__(self, engine: Engine, config: PDConfig) -> None:
        if engine.cache.tree is None:
            raise ValueError("pd_role: a prefill instance needs the prefix cache")
        self.engine = engine
        # Under tensor parallelism the KV goes after the prompt is computed, not during the forward.
        self._streams = engine.workers is None
        self._config = config
        self._hello = hello_for(engine, "prefill")
        self.num_served = 0
        self.num_refused = 0
        self.num_declined = 0
        self.num_links = 0
        self.num_dropped = 0  # links that broke (the decode side died, timed out, misbehaved)

    def serve_forever(self, listener: PrefillListener, stop: threading.Event) -> None:
        """Accept links one after the other until ``stop`` is set."""
        self.engine.bind_thread()
        while not stop.is_set():
            transport = listener.accept(stop)
            if transport is None:
                return
            try:
                self.serve_link(transport)
            except TransportError as exc:
                self.num_dropped += 1
                logger.warning("prefill: link dropped: %s", exc)
            except Exception:
                # A bug, not the peer: drop this link (its request was aborted) but keep serving.
                self.num_dropped += 1
                logger.exception("prefill: link dropped after an unexpected error")
            finally:
                transport.close()

    def serve_link(self, transport: KVTransport) -> None:
        """Serve one link until the decode side says goodbye.

        Raises:
            TransportError: the link broke (whatever was in flight was aborted first).
        """
        exchange_hello(transport, self._hello, first=False, timeout_s=self._config.connect_timeout_s)
        self.num_links += 1
        logger.info("prefill: serving %s", transport.peer)
        while True:
            message = transport.recv(None)
            match message:
                case Goodbye():
                    return
                case PrefillRequest():
                    self._serve_request(transport, message)
                case _:
                    got = type(message).__name__
                    raise TransportError(f"link to {transport.peer}: expected a PrefillRequest, got {got}")

    def _serve_request(self, transport: KVTransport, req: PrefillRequest) -> None:
        # The KV stream's sends; this thread sends nothing itself from its first KVLayer to finish().
        sender = QueuedSender(transport, self._config.timeout_s)
        try:
            self._compute_and_send(transport, req, sender)
        finally:
            sender.close()

    def _compute_and_send(self, transport: KVTransport, req: PrefillRequest, sender: QueuedSender) -> None:
        timeout = self._config.timeout_s
        first_page = req.held_len // self.engine.page_pool.page_size
        try:
            prompt = self._check(req)
            if req.may_decline:
                held_here = self.engine.cached_prefix_len(prompt, req.namespace)
                if declines(len(prompt), req.held_len, held_here):
                    self.num_declined += 1
                    transport.send(PrefillDeclined(req.xfer_id, held_here), timeout)
                    return
            first, cached = self._prefill(transport, req, prompt, sender)
            sender.finish()
            source = self.engine.transfer_source(prompt, first_page, req.namespace)
            if source is None:
                raise _Refused("the prompt's checkpoint is not in the prefill cache (evicted)")
            if self._streams and sender.num_sent != self._hello.kv_shape[0]:
                raise _Refused(f"{sender.num_sent} of {self._hello.kv_shape[0]} KV layers were streamed")
        except _Refused as exc:
            sender.finish()  # what was streamed goes first; the decode side drops it on TransferError
            self.num_refused += 1
            transport.send(TransferError(req.xfer_id, str(exc)), timeout)
            return
        if self._streams:
            conv, ssm = source.state()
        else:  # tensor-parallel: every layer now, gathered from the ranks (engine.transfer.pool_side)
            kv, conv, ssm = source.whole()
            for layer in range(kv.shape[0]):
                transport.send(KVLayer(req.xfer_id, layer, first_page, kv[layer]), timeout)
        transport.send(GDNState(req.xfer_id, conv, ssm), timeout)
        transport.send(PrefillDone(req.xfer_id, first, cached), timeout)
        self.num_served += 1

    def _check(self, req: PrefillRequest) -> list[int]:
        ids = req.token_ids
        if ids.dtype != torch.int64 or ids.dim() != 1 or not 0 <= req.held_len < ids.numel():
            raise _Refused(
                f"expected a 1-D int64 prompt and 0 <= held_len < its length, got {ids.dtype} "
                f"{tuple(ids.shape)} and held_len {req.held_len}"
            )
        return [int(t) for t in ids.tolist()]

    def _prefill(
        self, transport: KVTransport, req: PrefillRequest, prompt: list[int], sender: QueuedSender
    ) -> tuple[int, int]:
        """Run the prefill-only request to its end, streaming its KV; ``(first token, cached tokens)``."""
        try:
            params = SamplingParams(max_tokens=1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    seed=req.seed)
            rid = self.engine.add_request(prompt, params, prefill_only=True, sample_first=True, namespace=req.namespace)
        except (InvalidRequest, CapacityExceeded, ValueError) as exc:
            raise _Refused(f"refused: {exc}") from exc
        first_page = req.held_len // self.engine.page_pool.page_size
        runner = self.engine.runner
        if self._streams:
            runner.layer_hook = stream_hook(
                runner.caches, rid, first_page, self.engine.page_pool.page_size,
                lambda layer, kv: sender.put(KVLayer(req.xfer_id, layer, first_page, kv)),
            )
        done = False
        try:
            while True:
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    logger.exception("prefill: engine step failed")
                    raise _Refused(f"the prefill step failed: {exc!r}") from exc
                for out in outputs:
                    if out.request_id == rid and out.finished:
                        done = True
                        if out.finish_reason != "prefill" or not out.token_ids:
                            raise _Refused(f"the prefill instance has no room for {len(prompt)} tokens")
                        return out.token_ids[0], out.num_cached_tokens
                progress = PrefillProgress(req.xfer_id, self._num_computed(rid), len(prompt))
                transport.send(progress, self._config.timeout_s)
        finally:
            runner.layer_hook = None
            if not done:
                self.engine.abort_request(rid)

    def _num_computed(self, rid: str) -> int:
        return next((r.num_computed_tokens for r in self.engine.scheduler.running if r.request_id == rid), 0)


def run_prefill_worker(
    model: str, engine_config: EngineConfig, config: PDConfig, ready: Connection | None = None
) -> None:
    """Load the model and serve prefills until SIGINT/SIGTERM (``phloem serve --role prefill``).

    The listener binds ``config.peer`` (port 0: a free one). With ``ready``, a spawned process
    reports ``("ready", port)`` (or ``("error", text)``) on it once it listens.

    Raises:
        ValueError: a bad model folder or option, or the address cannot be bound.
    """
    use_nccl_defaults()  # before any NCCL group forms: tensor parallelism, the links' data groups
    try:
        engine = Engine.from_pretrained(model, engine_config)
        worker = PrefillWorker(engine, config)
        host, port = config.address if config.peer else ("127.0.0.1", 0)
        listener = PrefillListener(host, port, config.connect_timeout_s, engine.device)
    except (ValueError, EngineError) as exc:
        if ready is not None:
            ready.send(("error", str(exc)))
        raise ValueError(str(exc)) from exc
    stop, done = threading.Event(), threading.Event()

    def serve() -> None:
        try:
            worker.serve_forever(listener, stop)
        finally:
            done.set()

    # ``done``, not ``Thread.is_alive``: a thread inside a process group's C++ destructor (its
    # link's ``close``) can already read as stopped, and an exit then aborts the process.
    thread = threading.Thread(target=serve, name="phloem-prefill", daemon=True)
    thread.start()
    sys.stderr.write(f"phloem prefill: listening for a decode instance on {listener.host}:{listener.port}\n")
    if ready is not None:
        ready.send(("ready", listener.port))
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        stop.set()
    finally:
        signal.signal(signal.SIGTERM, previous)
        # Let the worker leave its TCPStore poll and close its link's groups before the
        # interpreter exits: a daemon thread inside a gloo or store call at exit aborts the
        # process (SIGABRT) instead of exiting 0. A link still open (recv without a deadline)
        # is left after the grace period.
        stop.set()
        done.wait(_STOP_GRACE_S)
        listener.close()
