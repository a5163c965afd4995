"""The offline engine: one process's inference core behind a small, stable API.

    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

A step reads as five calls: schedule → prepare → forward → sample → update. Requests are
validated when they are added (``engine.request_checks``), so a bad request raises at once and
never reaches the loop; the engine keeps serving the others. With async scheduling (the default)
a decode step's successor is queued on the device before the step's sampled ids are read
(``engine.step_pipeline``): ``step`` then launches one step and collects the one before.

Tensor parallelism (``tensor_parallel_size=N``): this process is rank 0 and the only one that
schedules, keeps the radix cache and samples; ``engine.tp_workers`` runs ranks 1..N-1 in child
processes, and each step the runner sends them a compact step plan before the shared forward.
``close()`` (or ``with Engine.from_pretrained(...) as engine``) stops them. Every rank captures
the same CUDA-graph buckets (with the collectives inside), and exported prefixes are gathered
from every rank into the TP=1 layout, so spilled sessions move between TP sizes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import torch

from phloem.engine import transfer_state
from phloem.engine.cache_manager import CacheManager, CacheStats
from phloem.engine.config import (
    CacheConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    default_max_num_batched_tokens,
)
from phloem.engine.errors import CorruptStep, InvalidRequest
from phloem.engine.grammar import GrammarBackend
from phloem.engine.kv_pages import PagePool
from phloem.engine.loader import load_model
from phloem.engine.model_runner import CausalLM, LaunchedStep, build_runner
from phloem.engine.parallel import TPGroup, check_tp_size
from phloem.engine.prefix_state import PrefixState, export_prefix, import_prefix
from phloem.engine.radix_cache import RadixCache, RadixNode
from phloem.engine.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from phloem.engine.request_checks import check_logit_bias, check_outputs, check_prompt, grammar_matcher
from phloem.engine.sampler import skip_draws
from phloem.engine.sampling_params import SamplingParams
from phloem.engine.scheduler import Scheduler
from phloem.engine.state_slots import SlotPool
from phloem.engine.step_pipeline import next_decode_step
from phloem.engine.tp_workers import TPWorkers, WorkerSpec, rank_device
from phloem.engine.transfer_state import TransferReservation, TransferSource
from phloem.engine.warmup import WarmupReport, warm_up

__all__ = ["Engine"]

_CACHE_OPTIONS = {
    "page_size",
    "memory_fraction",
    "state_fraction",
    "num_pages",
    "num_state_slots",
    "cpu_pool_bytes",
    "enable_prefix_caching",
    "checkpoint_interval",
    "checkpoint_prompt_end",
}
_SCHED_OPTIONS = {"max_num_batched_tokens", "max_num_seqs", "max_model_len", "async_scheduling"}
# ``show_progress`` reaches both the loader and the runner (CUDA-graph capture).
_RUNNER_OPTIONS = {"attention_backend", "enable_cuda_graph", "max_graph_batch_size", "show_progress"}
_LOAD_OPTIONS = {"load_format", "device", "dtype", "seed", "show_progress"}
_PARALLEL_OPTIONS = {"tensor_parallel_size", "expert_parallel"}


class Engine:
    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        dtype: torch.dtype,
        runner_config: RunnerConfig | None = None,
        workers: TPWorkers | None = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        runner_config = runner_config or RunnerConfig()
        # None (an engine without a tokenizer, as in tests): requests with a grammar are refused.
        self.grammar = grammar
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.workers = workers
        tp = workers.group if workers is not None else TPGroup.single(device)
        sink = workers.send if workers is not None else None
        self.runner, plan = build_runner(model_config, model, cache_config, runner_config, tp, dtype, sink)
        self.page_pool = PagePool(plan.num_pages, cache_config.page_size)
        self.slot_pool = SlotPool(plan.num_slots)
        tree = None
        if cache_config.enable_prefix_caching:
            tree = RadixCache(
                cache_config.page_size, self.page_pool.free, self.slot_pool.free, plan.page_bytes, plan.slot_bytes
            )
        self.cache = CacheManager(
            self.page_pool, self.slot_pool, self.runner.copy_page, tree, cache_config.checkpoint_interval,
            cache_config.checkpoint_prompt_end,
        )
        self.scheduler = Scheduler(scheduler_config, self.cache, finalize=tree is not None)
        graphs = None
        if runner_config.enable_cuda_graph and self.runner.attn is not None:
            # One page and one slot absorb the writes of a graph bucket's padding rows.
            pad_page, pad_slot = self.page_pool.allocate(1), self.slot_pool.allocate()
            assert pad_page is not None and pad_slot is not None, "pools too small for CUDA-graph padding"
            size = min(runner_config.max_graph_batch_size, scheduler_config.max_num_seqs)
            graphs = (size, pad_page[0], pad_slot)
        if workers is not None:
            workers.start(graphs)  # the workers capture the same buckets alongside rank 0
        if graphs is not None:
            self.runner.enable_cuda_graphs(*graphs, show_progress=runner_config.show_progress)
        limit = model_config.max_position_embeddings
        self.max_model_len = min(scheduler_config.max_model_len or limit, limit)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.async_scheduling = scheduler_config.async_scheduling
        # A decode step queued on the device behind the one being collected (async scheduling),
        # and outputs of a step collected outside ``step`` (by ``drain``), returned by the next.
        self._queued: LaunchedStep | None = None
        self._pending: list[RequestOutput] = []
        self.num_pipelined_steps = 0  # steps queued behind the step being collected
        # What the last ``step`` collected: "decode" (one token per request), "prefill" (no
        # one-token row) or "mixed"; the engine loop times steps by it.
        self.last_step_kind = "decode"

    @classmethod
    def from_pretrained(cls, path: str | Path, **options: object) -> Engine:
        """Load a Hugging Face model folder.

        Options: ``load_format`` ("safetensors" | "dummy"), ``device``, ``dtype``, ``seed``,
        ``page_size``, ``memory_fraction``, ``state_fraction``, ``num_pages``, ``num_state_slots``,
        ``cpu_pool_bytes``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, ``async_scheduling``,
        ``attention_backend``, ``enable_cuda_graph``, ``max_graph_batch_size``, ``show_progress``
        (progress bars while loading and capturing: False never, None when stderr is a terminal),
        ``tensor_parallel_size`` (N > 1 starts N - 1 worker processes; ``close()`` stops them),
        ``expert_parallel`` (routed experts split whole across those ranks).
        An unknown option is an error (never silently dropped).

        Raises:
            ValueError: a bad option, model folder or checkpoint; a tensor-parallel size that does
                not divide the heads, exceeds 8, or exceeds the visible GPUs.
            EngineError: a tensor-parallel worker failed to start.
        """
        known = _CACHE_OPTIONS | _SCHED_OPTIONS | _LOAD_OPTIONS | _RUNNER_OPTIONS | _PARALLEL_OPTIONS
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"Engine.from_pretrained: unknown option(s) {sorted(unknown)}")
        pick = lambda names: {k: v for k, v in options.items() if k in names}  # noqa: E731
        load_config = LoadConfig(**pick(_LOAD_OPTIONS))  # type: ignore[arg-type]
        load_config = replace(load_config, device=str(_with_index(torch.device(load_config.device))))
        parallel = ParallelConfig(**pick(_PARALLEL_OPTIONS))  # type: ignore[arg-type]
        cache_config = CacheConfig(**pick(_CACHE_OPTIONS))  # type: ignore[arg-type]
        budget = default_max_num_batched_tokens(load_config.device)
        sched = {"max_num_batched_tokens": budget, **pick(_SCHED_OPTIONS)}
        scheduler_config = SchedulerConfig(**sched)  # type: ignore[arg-type]
        runner_config = RunnerConfig(**pick(_RUNNER_OPTIONS))  # type: ignore[arg-type]
        model_config = ModelConfig.from_pretrained(path)
        tp_size = parallel.tensor_parallel_size
        check_tp_size(model_config, tp_size, torch.device(load_config.device), parallel.expert_parallel)
        workers = None
        if tp_size > 1:
            device = rank_device(torch.device(load_config.device), 0)
            load_config = replace(load_config, device=str(device))
            spec = WorkerSpec(
                str(path), model_config, load_config, cache_config, runner_config, tp_size, torch.get_num_threads(),
                parallel.expert_parallel,
            )
            workers = TPWorkers.launch(spec)
        try:
            _bind_cuda_device(torch.device(load_config.device))
            model = load_model(Path(path), model_config, load_config, workers.group if workers else None)
            if workers is not None:
                workers.wait_ready()
            dtype = next(model.parameters()).dtype
            device = torch.device(load_config.device)
            grammar = GrammarBackend(path, model_config.vocab_size, model_config.eos_token_ids)
            return cls(
                model_config, model, cache_config, scheduler_config, device, dtype, runner_config, workers, grammar
            )
        except BaseException:
            if workers is not None:
                workers.close()
            raise

    def bind_thread(self) -> None:
        """Prepare the calling thread to run this engine: on CUDA, make the engine's GPU the
        thread's current device; on CPU, give the thread one intra-op thread.

        Triton kernels, FlashInfer and new CUDA streams use the *current* device, and CUDA keeps
        it per thread: ``from_pretrained`` binds the constructing thread, and every other thread
        that runs this engine (the serving loop, the disaggregation threads) calls this first.
        Without it an engine on ``cuda:1`` launches its kernels against ``cuda:0``. On CPU a
        thread other than the main one starts an OpenMP team of its own beside the main
        thread's, and the two contend for the cores: one intra-op thread keeps the engine's
        steps as fast as in the main thread (docs/decisions.md).
        """
        _bind_cuda_device(self.device)
        if self.device.type == "cpu" and threading.current_thread() is not threading.main_thread():
            torch.set_num_threads(1)

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (idempotent; nothing to do at TP=1).

        A closed tensor-parallel engine can still be inspected but no longer steps.
        """
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
        *,
        sample_first: bool = False,
        output_token_ids: Sequence[int] = (),
        namespace: str | None = None,
    ) -> str:
        """Validate and enqueue a request; returns its id.

        With ``prefill_only`` the prompt is computed and a checkpoint published at its end, and
        nothing is sampled: the request finishes with reason ``"prefill"`` and no tokens; with
        ``sample_first`` too, it samples the token after the prompt and finishes with reason
        ``"prefill"`` and that one token (a disaggregated prefill's first token).

        ``output_token_ids`` are tokens already generated for this prompt elsewhere (a
        disaggregated prefill's first token): the request continues after them, and a seeded
        request's generator skips the draws they took, so its tokens equal a colocated run's.
        ``namespace``: the prefix-cache namespace (tenant) it matches and publishes in
        (``engine.radix_cache``); None: the shared one.

        A grammar is compiled on first use, then cached (``EngineClient`` compiles it first).

        Raises:
            InvalidRequest: empty prompt, token id outside the vocabulary, prompt at or over the
                context limit, a duplicate request id, a logit bias outside the vocabulary, or a
                grammar this engine cannot compile (or has no tokenizer for).
            CapacityExceeded: the prompt cannot fit the KV pool even when it is empty.
        """
        prompt = self._validate(prompt_token_ids, params)
        check_logit_bias(params, self.model_config.vocab_size)
        outputs = check_outputs(
            prompt, output_token_ids, params, prefill_only, sample_first, self.model_config.vocab_size,
            self.max_model_len,
        )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest(f"request_id: {rid!r} is already in flight")
        req = Request(
            rid, prompt + outputs, params, arrival_idx=next(self._ids), num_prompt_tokens=len(prompt),
            prefill_only=prefill_only, sample_first=sample_first, namespace=namespace,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
            if not params.is_greedy:
                skip_draws(req.generator, self.model_config.vocab_size, len(outputs), self.device)
        if params.grammar is not None:
            req.grammar = grammar_matcher(self.grammar, params, outputs)
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return check_prompt(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len, self.page_pool)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its memory; returns False if it is unknown or already done."""
        self.drain()
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        # What the drained step sampled for it is dropped: an aborted request reports nothing more.
        self._pending = [o for o in self._pending if o.request_id != request_id]
        self._requests.pop(request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._queued is not None or bool(self._pending)

    def is_stalled(self) -> bool:
        """Requests wait but none runs: the last step could admit none (their memory is held,
        e.g. by pinned prefixes); stepping again changes nothing until something is freed."""
        return bool(self.scheduler.waiting) and not self.scheduler.running and self._queued is None and not self._pending

    def waits_for_memory(self, request_id: str) -> bool:
        """Whether ``request_id`` is waiting because the pools have no room for it (the last
        admission was refused after eviction), rather than for its turn in the batch."""
        req = self._requests.get(request_id)
        return req is not None and req.status is RequestStatus.WAITING and self.scheduler.memory_blocked

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that changed.

        With async scheduling (``SchedulerConfig.async_scheduling``) a step may leave the next
        decode step queued on the device (``engine.step_pipeline``): the call then returns the
        outputs of the step it collected, and the next call collects the queued one.
        """
        outputs, self._pending = self._pending, []
        launched, self._queued = self._queued, None
        if launched is None:
            sched = self.scheduler.schedule()
            outputs += [self._output(r, []) for r in sched.finished_early]
            if sched.is_empty:
                return outputs
            launched = self.runner.launch(sched)
        counts = launched.sched.num_new_tokens
        self.last_step_kind = "decode" if all(n == 1 for n in counts) else "mixed" if 1 in counts else "prefill"
        if self._pipelined():
            following = next_decode_step(launched, self.scheduler, self.cache, self.max_model_len)
            if following is not None:
                sched, inputs, input_ids = following
                self._queued = self.runner.launch(sched, inputs, input_ids)
                self.num_pipelined_steps += 1
        try:
            outputs += self._apply(launched)
        except CorruptStep:
            self._drop_corrupt(launched)
            raise
        if self._queued is not None:
            # Its grammar masks and penalties read the tokens ``_apply`` just appended.
            self._queued = self.runner.sample_queued(self._queued)
        return outputs

    def _pipelined(self) -> bool:
        return self.async_scheduling and self.runner.layer_hook is None

    def drain(self) -> None:
        """Collect the queued step, if any (its outputs go out with the next ``step``), so the
        requests' counters and memory are those of a synchronous engine between steps. The
        engine calls it before anything that reads or changes request memory from outside."""
        launched, self._queued = self._queued, None
        if launched is not None:
            try:
                self._pending += self._apply(launched)
            except CorruptStep:
                self._drop_corrupt(launched)
                raise

    def _drop_corrupt(self, launched: LaunchedStep) -> None:
        """Abort the requests of a corrupt step and of the step queued behind it (which ran on its
        ids), publishing nothing: their GDN state on the device is past their counters."""
        queued, self._queued = self._queued, None
        for step in (launched, queued):
            for req in step.sched.requests if step is not None else ():
                if req.status is RequestStatus.FINISHED and not req.finalizing:
                    continue
                req.has_state = False  # ``release`` then frees the write slot instead of publishing it
                self.scheduler.abort(req.request_id)
                self._requests.pop(req.request_id, None)

    def _apply(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Collect a launched step and advance its requests by what it computed and sampled;
        their outputs."""
        sched, result = launched.sched, self.runner.collect(launched)
        vocab = self.model_config.vocab_size
        impossible = {rid: t for rid, t in result.sampled.items() if not 0 <= t < vocab}
        if impossible:
            raise CorruptStep(f"the step sampled token ids outside the vocabulary [0, {vocab}): {impossible}")
        outputs: list[RequestOutput] = []
        for req, n in zip(sched.requests, sched.num_new_tokens):
            if req.is_finished and not req.finalizing:
                continue  # stopped (or aborted) while a queued step computed one more token
            req.num_computed_tokens += n
            req.has_state = True
            req.read_slot = req.write_slot
            if req.finalizing:
                self.scheduler.complete_finalize(req)
                continue
            if req.prefill_only and req.num_computed_tokens == req.num_tokens:
                # The prompt is computed: publishing on release puts the checkpoint at its end
                # (at num_computed_tokens: a first token sampled here is not part of it).
                first = result.sampled.get(req.request_id)
                if first is not None:
                    req.append_output(first)
                self.scheduler.finish_now(req, FinishReason.PREFILL)
                outputs.append(self._output(req, [] if first is None else [first], result.logprobs.get(req.request_id)))
                continue
            self.cache.maybe_checkpoint(req)
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(self._output(req, [token], result.logprobs.get(req.request_id)))
        return outputs

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.model_config.eos_token_ids):
            return FinishReason.STOP
        if req.grammar is not None and req.grammar.is_terminated:
            return FinishReason.STOP
        if req.reaches_length(self.max_model_len):
            return FinishReason.LENGTH
        return None

    def _output(self, req: Request, new_tokens: list[int], logprob: TokenLogprob | None = None) -> RequestOutput:
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self._requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            new_token_ids=new_tokens,
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=req.num_cached_tokens,
            new_logprobs=(logprob,) if logprob is not None else None,
        )

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        namespace: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (in the prefix cache's ``namespace``); outputs come back in
        prompt order. Every prompt is validated before any is enqueued, so a bad one raises and
        runs nothing.
        """
        plist = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(plist) != len(prompt_token_ids):
            raise InvalidRequest(f"params: expected {len(prompt_token_ids)} SamplingParams, got {len(plist)}")
        for prompt, p in zip(prompt_token_ids, plist):
            self._validate(prompt, p)
        ids = [self.add_request(prompt, p, namespace=namespace) for prompt, p in zip(prompt_token_ids, plist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        # Let turn-end checkpoints land, so a follow-up call hits the whole conversation.
        while self.scheduler.num_finalizing() or self._queued is not None:
            self.step()
        return [final[i] for i in ids]

    def warm_up(self, show_progress: bool | None = None) -> WarmupReport:
        """Run every kind of step serving will use once, so the kernels a first request would
        compile compile now; the engine is left empty (``engine.warmup``)."""
        return warm_up(self, show_progress)

    def pin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> RadixNode | None:
        """Pin the deepest checkpoint within ``token_ids`` cached in ``namespace`` (a session's
        head) against eviction.

        Returns an opaque handle for ``unpin_prefix``, or None when nothing of it is cached.
        """
        tree = self.cache.tree
        if tree is None:
            return None
        match = tree.match(list(token_ids), len(token_ids), namespace)
        if match is None:
            return None
        tree.lock(match.node)
        return match.node

    def unpin_prefix(self, handle: RadixNode) -> None:
        assert self.cache.tree is not None, "unpin without a prefix cache"
        self.cache.tree.unlock(handle)

    def cached_prefix_len(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` a new request in ``namespace`` would take from the cache."""
        tree = self.cache.tree
        match = tree.match(list(token_ids), len(token_ids) - 1, namespace) if tree is not None and token_ids else None
        return match.num_tokens if match else 0

    def export_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> PrefixState | None:
        """Host copies of the KV pages and head checkpoint of the deepest prefix of ``token_ids``
        cached in ``namespace`` (for spilling a session), in the TP=1 layout whatever the
        tensor-parallel size (``engine.tp_state``); None when nothing of it is cached."""
        self.drain()
        return export_prefix(self.cache, self.runner.read_state, list(token_ids), namespace)

    def import_prefix(self, state: PrefixState, namespace: str | None = None) -> bool:
        """Load a spilled prefix into fresh pages and a fresh slot and publish it in the radix
        cache, in ``namespace``; False (taking nothing) when no room can be made.

        Raises:
            ValueError: the tensors do not have this model's (TP=1 layout) shapes.
        """
        self.drain()
        return import_prefix(self.cache, state, self.runner.state_shapes, self.runner.write_state, namespace)

    def reserve_transfer(
        self, token_ids: Sequence[int], params: SamplingParams, local_up_to: int = 0, namespace: str | None = None
    ) -> TransferReservation | None:
        """Decode side of a disaggregated prefill: lock the cached prefix of ``token_ids`` and
        reserve pages and a state slot for the rest (``engine.transfer_state``), in ``namespace``.

        Returns None (taking nothing) when a prefix is cached and at most ``local_up_to`` tokens
        lie past it (compute them here), or when no room can be made. Every reservation ends in
        ``install_transfer`` or ``release_transfer``.

        Raises:
            InvalidRequest, CapacityExceeded: as ``add_request`` would for this prompt.
        """
        prompt = self._validate(token_ids, params)
        self.drain()
        return transfer_state.reserve(self.cache, prompt, local_up_to, namespace)

    def install_transfer(
        self, reservation: TransferReservation, kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> None:
        """Copy a transferred prompt's KV (``[attn_layers, reserved pages, 2, ps, Hkv, D]``) and
        final GDN state, in the TP=1 layout, into the reservation (every rank's part under tensor
        parallelism) and publish it in the prefix cache.

        Raises:
            ValueError: the tensors do not match the reservation (it is left as it was).
        """
        self.drain()
        transfer_state.install(self.cache, self.runner.state_shapes, self.runner.write_state, reservation, kv, conv, ssm)

    def release_transfer(self, reservation: TransferReservation) -> None:
        """Give back what ``reserve_transfer`` took (idempotent; a no-op after install)."""
        self.drain()
        transfer_state.release(self.cache, reservation)

    def transfer_source(
        self, token_ids: Sequence[int], first_page: int, namespace: str | None = None
    ) -> TransferSource | None:
        """Prefill side: the pages (from ``first_page``) and state slot of the checkpoint at the end
        of ``token_ids``, as a prefill-only request in ``namespace`` published it (read in the
        TP=1 layout); None when it is not cached."""
        self.drain()
        return transfer_state.transfer_source(self.cache, self.runner.read_state, list(token_ids), first_page, namespace)

    def cache_stats(self) -> CacheStats:
        """Prefix-cache and pool counters (prompt vs cached tokens, checkpoints, pages in use)."""
        return self.cache.stats()


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current device>``: the engine stays on the GPU it was built on whatever
    thread runs it later (``torch.cuda.set_device`` refuses a device without an index). Without
    CUDA the device is left as given, for the clear errors of the checks that follow."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _bind_cuda_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(_with_index(device))
