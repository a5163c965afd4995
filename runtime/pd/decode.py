"""The decode instance's ``EngineClient``: prompts are prefilled by the prefill instance.

Sessions and the API use it exactly like ``EngineClient``; only ``generate`` differs::

    ReserveTransfer (engine thread)   lock the cached prefix (held_len), reserve pages + a slot
      │ None: a short extension of a cached prefix, or no room ─────────▶ local generate
      ▼
    DecodeLink.transfer (transfer thread)   PrefillRequest ─▶ KV per layer, GDN state, first token
      │ Declined ─▶ ReleaseTransfer ─▶ local generate (the prefill side holds too little of it)
      │ TransferFailed ─▶ ReleaseTransfer ─▶ retry once locally (retry_local) or EngineError
      ▼
    InstallTransfer (engine thread)   copy into the reservation, publish at the prompt's end
      ▼
    yield the first token; AddRequest(prompt, output_token_ids=(first,)) ─▶ decode as usual

Every reservation ends in exactly one install or release, whatever happens to the consumer
(cancelled, closed early) or the peer. Transfers run one at a time on one daemon thread (the link
carries one transfer at a time); a consumer that goes away mid-transfer releases the reservation
at once and the thread finishes the protocol and drops the result.

``abort`` of a request still in transfer marks it: it ends with reason ``"abort"`` once the
transfer is over. Outputs report ``num_cached_tokens`` as the prompt tokens the prefill side took
from its cache (the tokens not computed for this request). A first token that already ends the
request (a stop token, ``max_tokens == 1``, the context limit) ends it there; its turn-end
checkpoint is then at the prompt's end, one token short of a colocated run's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from phloem.engine import Engine, EngineConfig, EngineError, InvalidRequest, RequestOutput, SamplingParams
from phloem.engine.transfer import KVTransport, PrefixState, TransferReservation, connect
from phloem.runtime.engine_client import EngineClient
from phloem.runtime.engine_commands import InstallTransfer, ReleaseTransfer, ReserveTransfer
from phloem.runtime.env import use_nccl_defaults
from phloem.runtime.pd.link import Declined, DecodeLink, TransferFailed, TransferResult, hello_for
from phloem.runtime.pd.roles import PDConfig

__all__ = ["PDEngineClient", "engine_client_for"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def engine_client_for(model: str, config: EngineConfig, pd: PDConfig) -> EngineClient:
    """The engine client ``phloem serve`` runs (``cli.compose``): a ``PDEngineClient`` for
    ``--role decode``, else a plain ``EngineClient``; not started.

    Args:
        model: The model folder.
        config: The engine's configuration.
        pd: The instance's disaggregation settings.

    Raises:
        ValueError: the model folder or an engine option is invalid; the role is ``prefill``
            (that instance serves no HTTP: ``runtime.pd.prefill``).
    """
    if pd.role == "prefill":
        raise ValueError("pd_role: a prefill instance serves no HTTP API; run runtime.pd.prefill.serve_prefill")
    use_nccl_defaults()  # before any NCCL group forms: tensor parallelism, the link's data group
    engine = Engine.from_pretrained(model, config)
    if pd.role == "decode":
        return PDEngineClient(engine, pd)
    return EngineClient(engine)


@dataclass(slots=True)
class _Pending:
    aborted: bool = False


class _TransferThread:
    """One daemon thread, started on first use, running submitted calls in order (a pool's
    threads are not daemons: one blocked on a dead peer would hold up interpreter exit)."""

    def __init__(self, on_start: Callable[[], None]) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._on_start = on_start

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phloem-pd-transfer", daemon=True)
            self._thread.start()
        future: Future[T] = Future()
        self._calls.put((future, fn))
        return future

    def stop(self, timeout: float) -> None:
        """Run ``fn``-s already queued, then end; wait up to ``timeout`` s for that."""
        if self._thread is not None:
            self._calls.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        self._on_start()
        while (item := self._calls.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


class PDEngineClient(EngineClient):
    """``EngineClient`` of a decode instance (``docs/disaggregation.md``).

    Args:
        engine: The decode engine (prefix cache on; any tensor-parallel size).
        config: Disaggregation settings; ``config.peer`` is the prefill instance.
        connector: Opens a link to the prefill instance; None: ``torch.distributed`` to
            ``config.peer`` (``engine.transfer.dist_transport.connect``).

    Raises:
        ValueError: the engine runs without a prefix cache.
    """

    def __init__(self, engine: Engine, config: PDConfig, connector: Callable[[], KVTransport] | None = None) -> None:
        if engine.cache.tree is None:
            raise ValueError("pd_role: a decode instance needs the prefix cache")
        super().__init__(engine)
        if connector is None:
            host, port = config.address
            device = engine.device

            def connector() -> KVTransport:
                return connect(host, port, config.connect_timeout_s, device)

        self._config = config
        self._link = DecodeLink(config, hello_for(engine, "decode"), connector)
        self._thread = _TransferThread(engine.bind_thread)
        self._pending: dict[str, _Pending] = {}
        self._eos = engine.model_config.eos_token_ids
        self.num_remote = 0  # requests prefilled by the prefill instance
        self.num_local = 0  # prefilled here by choice (a short extension, no room to reserve, declined)
        self.num_declined = 0  # of those, declined by the prefill side (it held too little of the prompt)
        self.num_failed = 0  # transfers that failed (then retried locally or failed)

    def _stop(self, timeout: float | None) -> None:
        try:
            super()._stop(timeout)
        finally:
            # Say goodbye to the prefill instance after any transfer still running (bounded: a
            # transfer stuck on a silent peer ends with its own timeout; the thread is a daemon).
            self._thread.submit(self._link.close)
            self._thread.stop(timeout=2.0)

    async def abort(self, request_id: str) -> bool:
        """As ``EngineClient.abort``; a request still in transfer ends with ``"abort"`` after it."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.aborted = True
            return True
        return await super().abort(request_id)

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        prefill_only: bool = False,
        namespace: str | None = None,
        hold_turn_end: bool = False,
        resume: PrefixState | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As ``EngineClient.generate``, with the prompt prefilled by the prefill instance (which
        matches and publishes in the same prefix-cache ``namespace``). A ``resume`` state is
        loaded here first unless the cache holds it (then a hit like any cached prefix; no room:
        prefilled); the outputs report the tokens it loaded (``num_resumed_tokens``)."""
        resumed = 0
        if resume is not None:
            held = await self.cached_prefix_len(prompt_token_ids, namespace)  # as ``Engine._take_resume``
            if held < resume.num_tokens and await self.import_prefix(resume, namespace):
                resumed = resume.num_tokens
        stream = self._generate(list(prompt_token_ids), params, request_id, output_token_ids, prefill_only,
                                namespace, hold_turn_end)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield replace(out, num_resumed_tokens=resumed) if resumed else out

    async def _generate(
        self, prompt: list[int], params: SamplingParams, request_id: str | None, output_token_ids: Sequence[int],
        prefill_only: bool, namespace: str | None, hold_turn_end: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        # The prefill instance samples the first token with plain parameters only: a request whose
        # logits are processed (grammar, penalties, bias) or reported (logprobs) prefills here.
        if output_token_ids or prefill_only or params.processes_logits or params.logprobs is not None:
            async for out in super().generate(
                prompt, params, rid, output_token_ids=output_token_ids, prefill_only=prefill_only, namespace=namespace,
                hold_turn_end=hold_turn_end,
            ):
                yield out
            return
        if rid in self._pending:
            raise InvalidRequest(f"request_id: {rid!r} is already in flight")
        res = await self._call(ReserveTransfer(tuple(prompt), params, self._config.local_prefill_tokens, namespace))
        if res is None:
            self.num_local += 1
            async for out in super().generate(prompt, params, rid, namespace=namespace, hold_turn_end=hold_turn_end):
                yield out
            return
        pending = self._pending[rid] = _Pending()
        try:
            result = await self._prefill_remote(res, params)
            if result is None:
                del self._pending[rid]
                if pending.aborted:
                    yield RequestOutput(rid, prompt, [], [], True, "abort", 0)
                    return
                async for out in super().generate(prompt, params, rid, namespace=namespace, hold_turn_end=hold_turn_end):
                    yield out
                return
            async for out in self._continue(rid, prompt, params, result, pending, namespace, hold_turn_end):
                yield out
        finally:
            if self._pending.get(rid) is pending:
                del self._pending[rid]

    async def _prefill_remote(self, res: TransferReservation, params: SamplingParams) -> TransferResult | None:
        """Transfer and install; None when the request is to be prefilled locally (declined, or
        failed and retried).

        Raises:
            EngineError: it failed and ``retry_local`` is off.
        """
        installed = False
        try:
            result = await asyncio.wrap_future(self._thread.submit(lambda: self._link.transfer(res, params)))
            await self._call(InstallTransfer(res, result.kv, result.conv, result.ssm))
            installed = True
            self.num_remote += 1
            return result
        except Declined as exc:
            self.num_declined += 1
            self.num_local += 1
            logger.info("prefill instance declined (%s); prefilling on the decode instance", exc)
            return None
        except TransferFailed as exc:
            self.num_failed += 1
            if not self._config.retry_local:
                raise EngineError(f"disaggregated prefill failed: {exc}") from exc
            logger.warning("disaggregated prefill failed (%s); retrying the request on the decode instance", exc)
            return None
        finally:
            if not installed:
                # Also on cancellation: queued behind an install already sent, it is a no-op.
                self._submit_quietly(ReleaseTransfer(res))

    async def _continue(
        self, rid: str, prompt: list[int], params: SamplingParams, result: TransferResult, pending: _Pending,
        namespace: str | None, hold_turn_end: bool,
    ) -> AsyncGenerator[RequestOutput, None]:
        first, cached = result.first_token, result.num_cached
        reason = self._first_token_stop(prompt, params, first)
        if reason is None and pending.aborted:
            reason = "abort"
        yield RequestOutput(rid, prompt, [first], [first], reason is not None, reason, cached)
        if reason is not None:
            return
        if pending.aborted:
            yield RequestOutput(rid, prompt, [first], [], True, "abort", cached)
            return
        # From here ``abort`` must reach the engine: the AddRequest below is queued before any await.
        del self._pending[rid]
        inner = super().generate(prompt, params, rid, output_token_ids=(first,), namespace=namespace,
                                 hold_turn_end=hold_turn_end)
        try:
            async for out in inner:
                yield replace(out, token_ids=out.token_ids or [first], num_cached_tokens=cached)
        finally:
            await inner.aclose()

    def _first_token_stop(self, prompt: list[int], params: SamplingParams, token: int) -> str | None:
        """``StepOutputs._stop_reason`` (``engine.step_outputs``) for the first token, which the prefill side sampled."""
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos):
            return "stop"
        if params.max_tokens <= 1 or len(prompt) + 1 >= self.max_model_len:
            return "length"
        return None
