"""The offline engine: one process's inference core behind a small, stable API.

    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

A step reads as five calls: schedule → prepare → forward → sample → update. Requests are
validated when they are added (``engine.request_checks``), so a bad request raises at once and
never reaches the loop; the engine keeps serving the others. With async scheduling (the default)
a decode step's successor is queued on the device before the step's sampled ids are read
(``engine.step_pipeline``): ``step`` then launches one step and collects the one before.

Tensor parallelism (``ParallelConfig.tensor_parallel_size=N``): this process is rank 0 and the
only one that schedules, keeps the radix cache and samples; ``engine.workers`` runs ranks
1..N-1 in child processes (``close()`` stops them), each step sent a compact plan before the
shared forward. Exported prefixes are gathered into the TP=1 layout, so spilled sessions move
between TP sizes.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from phloem.engine.build import bind_cuda_device, load_parts
from phloem.engine.cache.kv_pages import PagePool
from phloem.engine.cache.manager import CacheManager, CacheStats
from phloem.engine.cache.radix import RadixCache
from phloem.engine.cache.state_slots import SlotPool
from phloem.engine.config import EngineConfig, ModelConfig
from phloem.engine.errors import CorruptStep, InvalidRequest
from phloem.engine.model_runner import CausalLM, LaunchedStep, build_runner
from phloem.engine.parallel.group import TPGroup
from phloem.engine.prefix_ops import PrefixOps
from phloem.engine.request import MemoryWait, Request, RequestOutput, RequestStatus
from phloem.engine.request_checks import check_logit_bias, check_outputs, check_prompt, grammar_matcher
from phloem.engine.sampling.grammar import GrammarBackend
from phloem.engine.sampling.params import SamplingParams
from phloem.engine.sampling.sampler import skip_draws
from phloem.engine.scheduler import Scheduler
from phloem.engine.speculative import MTPSpeculator, SpeculationStats, extra_kv_layers
from phloem.engine.transfer.prefix_export import PrefixState
from phloem.engine.step_outputs import StepOutputs
from phloem.engine.step_pipeline import next_step
from phloem.engine.warmup import WarmupReport, warm_up
from phloem.engine.workers import TPWorkers
from phloem.kernels.dispatch import kernel_backend

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


class Engine(PrefixOps):
    """One process's inference core; ``from_pretrained`` loads one. The constructor takes a
    loaded ``model`` (rank 0's shard), the ``device`` it is on (``config.load.device`` is not
    read), the tensor-parallel ``workers`` (None at TP=1) and the ``grammar`` backend (None, an
    engine without a tokenizer as in tests: requests with a grammar are refused)."""

    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        workers: TPWorkers | None = None,
        grammar: GrammarBackend | None = None,
    ) -> None:
        cache_config, runner_config = config.cache, config.runner
        scheduler_config = config.scheduler.for_device(str(device))
        self.config = config
        self.grammar = grammar
        self.model_config = model_config
        self.device, self.dtype, self.workers = device, dtype, workers
        tp = workers.group if workers is not None else TPGroup.single(device)
        sink = workers.send if workers is not None else None
        self.runner, plan = build_runner(model_config, model, cache_config, runner_config, tp, dtype, sink,
                                         kernels=config.kernels,
                                         extra_kv_layers=extra_kv_layers(config.speculative, model_config))
        self.page_pool = PagePool(plan.num_pages, cache_config.page_size)
        self.slot_pool = SlotPool(plan.num_slots)
        logger.info("cache: %d KV pages (%d tokens, %.2f GiB), %d GDN state slots (%.2f GiB)",
                    plan.num_pages, plan.num_pages * cache_config.page_size, plan.num_pages * plan.page_bytes / 2**30,
                    plan.num_slots, plan.num_slots * plan.slot_bytes / 2**30)
        tree = None
        if cache_config.enable_prefix_caching:
            tree = RadixCache(
                cache_config.page_size, self.page_pool.free, self.slot_pool.free, plan.page_bytes, plan.slot_bytes
            )
        self.cache = CacheManager(
            self.page_pool, self.slot_pool, self.runner.copy_page, tree, cache_config.checkpoint_interval,
            cache_config.checkpoint_prompt_end, cache_config.prompt_end_split_min_tokens,
            cache_config.handoff_hold_s,
        )
        # At TP=1 a resume's prefix loads at admission, beside the steps; under tensor parallelism
        # a load is a collective with the workers, so it runs when the request is added.
        self.scheduler = Scheduler(scheduler_config, self.cache, finalize=tree is not None,
                                   load_prefix=self.import_prefix if tree is not None and self.runner.tp.size == 1 else None)
        limit = model_config.max_position_embeddings
        self.max_model_len = min(scheduler_config.max_model_len or limit, limit)
        # Speculative decoding (``engine.speculative``) runs in the synchronous loop, its steps
        # eager; plain steps keep the CUDA graphs below. Built first: it refuses what it cannot run.
        self.speculator = MTPSpeculator.build(config.speculative, self.runner, self.cache, model_config,
                                              self.max_model_len)
        graphs = None
        capturable = kernel_backend(device, config.kernels) == "triton"  # the torch ops read values on the host
        if runner_config.enable_cuda_graph and self.runner.attn is not None and capturable:
            # One page and one slot absorb the writes of a graph bucket's padding rows.
            pad_page, pad_slot = self.page_pool.allocate(1), self.slot_pool.allocate()
            assert pad_page is not None and pad_slot is not None, "pools too small for CUDA-graph padding"
            size = min(runner_config.max_graph_batch_size, scheduler_config.max_num_seqs)
            graphs = (size, pad_page[0], pad_slot)
        if workers is not None:
            workers.start(graphs)  # the workers capture the same buckets alongside rank 0
        if graphs is not None:
            prefill = min(runner_config.prefill_graph_tokens, scheduler_config.max_num_batched_tokens)
            prefill = prefill if workers is None else 0
            self.runner.enable_cuda_graphs(*graphs, show_progress=config.load.show_progress, prefill_tokens=prefill)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._outputs = StepOutputs(model_config, self.scheduler, self.cache, self.max_model_len, self._requests)
        self.async_scheduling = scheduler_config.async_scheduling and self.speculator is None
        self._queued: LaunchedStep | None = None  # a step queued behind the one collected
        self._pending: list[RequestOutput] = []  # outputs collected by ``drain``, for the next step
        self.num_pipelined_steps = 0  # steps queued behind the step being collected
        self.num_pipelined_mixed_steps = 0  # of those, steps that admitted waiting requests
        self.last_step_kind = "decode"  # ``SchedulerOutput.kind`` of the step ``step`` collected

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        config: EngineConfig | None = None,
        *,
        load_format: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        **sections: Any,
    ) -> Engine:
        """Load a Hugging Face model folder.

        Args:
            path: the model folder (``config.json``, safetensors, tokenizer).
            config: the engine's configuration; None: ``EngineConfig()``.
            load_format: ``"safetensors"`` or ``"dummy"`` (random weights); overrides ``config.load``.
            device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; overrides ``config.load``.
            dtype: ``"auto"``, ``"bfloat16"``, ``"float16"`` or ``"float32"``; overrides ``config.load``.
            **sections: whole sections replacing the config's (``cache=CacheConfig(num_pages=64)``,
                ``EngineConfig.with_sections``); a section's option alone (``num_pages=64``) is a
                ``TypeError`` naming its section.

        Returns:
            The engine. At ``tensor_parallel_size`` N > 1 it runs N - 1 worker processes:
            ``close()`` (or ``with``) stops them.

        Raises:
            TypeError: ``config`` is not an ``EngineConfig``, or an option is not a section.
            ValueError: a bad option, model folder or checkpoint; a tensor-parallel size that does
                not divide the heads, exceeds 8, or exceeds the visible GPUs.
            EngineError: a tensor-parallel worker failed to start.
        """
        config = config if config is not None else EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"Engine.from_pretrained: config: expected an EngineConfig, got {type(config).__name__}")
        config = config.with_sections(**sections)
        load = {k: v for k, v in (("load_format", load_format), ("device", device), ("dtype", dtype)) if v is not None}
        parts = load_parts(path, config.with_sections(load=replace(config.load, **load)) if load else config)
        try:
            return cls(
                parts.model_config, parts.model, parts.config, parts.device, parts.dtype, parts.workers, parts.grammar
            )
        except BaseException:
            if parts.workers is not None:
                parts.workers.close()
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
        bind_cuda_device(self.device)
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
        hold_turn_end: bool = False,
        resume: PrefixState | None = None,
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
        (``engine.cache.radix``); None: the shared one. ``hold_turn_end``: keep the checkpoint
        published when it finishes locked until a ``pin_prefix`` of it (or
        ``CacheConfig.handoff_hold_s``), so memory pressure cannot evict a session's new head
        before the session pins it (``engine.cache.holds``). ``resume``: a spilled prefix of
        the prompt (``export_prefix``'s state, from a session tier) the request starts from:
        loaded into the cache when the request is admitted, in queue order, unless the cache
        holds it then (``Scheduler._load_resume``; under tensor parallelism, now). A state that
        is not a prefix of the prompt, or that cannot be loaded, is ignored (recomputed).

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
            prefill_only=prefill_only, sample_first=sample_first, namespace=namespace, hold_turn_end=hold_turn_end,
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
            if not params.is_greedy:
                skip_draws(req.generator, self.model_config.vocab_size, len(outputs), self.device)
        if params.grammar is not None:
            req.grammar = grammar_matcher(self.grammar, params, outputs)
        if resume is not None:
            self._take_resume(req, resume)
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

    def attach_resume(self, request_id: str, resume: PrefixState) -> bool:
        """Give a request still waiting for admission a spilled prefix of its prompt to load as
        it is admitted (``add_request``'s ``resume``): its session let go of the pin that held
        that prefix, so that the requests it waited behind can run. False (nothing changed) when
        the request runs or is unknown, or the state is not a prefix of its prompt."""
        req = self._requests.get(request_id)
        return req is not None and req.status is RequestStatus.WAITING and self._take_resume(req, resume)

    def _take_resume(self, req: Request, resume: PrefixState) -> bool:
        """Attach ``resume`` to waiting ``req`` (loaded at admission), or at TP > 1 load it now;
        False when it is not a strict prefix of the request's tokens (or no prefix cache)."""
        if self.cache.tree is None or resume.num_tokens >= len(req.all_token_ids) \
                or list(resume.token_ids) != req.all_token_ids[: resume.num_tokens]:
            return False
        if self.scheduler.load_prefix is not None:
            req.resume = resume
            req.num_uncached_hint = None
        elif self.cached_prefix_len(req.all_token_ids, req.namespace) < resume.num_tokens \
                and self.import_prefix(resume, req.namespace):  # no room: recomputed
            req.num_resumed_tokens = resume.num_tokens
        return True

    def waits_for_memory(self, request_id: str) -> MemoryWait:
        """Whether ``request_id`` is waiting because the pools have no room for it (the last
        admission was refused after eviction), rather than for its turn in the batch; and if
        so, whether anything runs that will give memory back (else ``STALLED``)."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.WAITING or not self.scheduler.memory_blocked:
            return MemoryWait.NO
        # Hand-off holds end by themselves (``handoff_hold_s``): memory comes back then.
        return MemoryWait.STALLED if self.is_stalled() and not self.cache.holds else MemoryWait.FOR_MEMORY

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that changed.

        With async scheduling (``SchedulerConfig.async_scheduling``) a step may leave the next
        step queued on the device (``engine.step_pipeline``): the call then returns the
        outputs of the step it collected, and the next call collects the queued one.
        """
        self.cache.imports.settle()  # unlock resumed prefixes whose copy has ended
        self.cache.holds.expire()  # turn ends and imports no next user took in time
        outputs, self._pending = self._pending, []
        launched, self._queued = self._queued, None
        if launched is None:
            sched = self.scheduler.schedule()
            outputs += [self._outputs.output(r, []) for r in sched.finished_early]
            if sched.is_empty:
                return outputs
            if self.speculator is not None:
                spec = self.speculator.try_step(sched)
                if spec is not None:
                    self.last_step_kind = sched.kind
                    return outputs + self._outputs.apply_runs(sched, spec.tokens, spec.logprobs)
                self.speculator.before_plain_step(sched, self.scheduler.running)
            launched = self.runner.launch(sched)
        self.last_step_kind = launched.sched.kind
        if self._pipelined():
            following = next_step(launched, self.scheduler, self.cache, self.max_model_len, self.runner.prepare_inputs)
            if following is not None:
                sched, inputs, input_ids = following
                self._queued = self.runner.launch(sched, inputs, input_ids)
                self.num_pipelined_steps += 1
                self.num_pipelined_mixed_steps += sched.kind != "decode"
        outputs += self._apply(launched)
        if self._queued is not None:  # its grammar masks and penalties read the tokens just applied
            self._queued = self.runner.sample_queued(self._queued)
        return outputs

    def _pipelined(self) -> bool:
        return self.async_scheduling and self.runner.layer_hook is None

    def drain(self) -> None:
        """Collect the queued step, if any (its outputs go out with the next ``step``), and order
        the engine's stream after the queued import copies (``engine.cache.import_fences``), so
        the requests' counters and memory are those of a synchronous engine between steps. The
        engine calls it before anything that reads or changes request memory from outside."""
        launched, self._queued = self._queued, None
        if launched is not None:
            self._pending += self._apply(launched)
        self.cache.imports.wait_all()

    def _apply(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Collect a launched step and advance its requests (``engine.step_outputs``); their
        outputs. A corrupt step's requests, and those of the step queued behind it (which ran on
        its ids), are dropped before ``CorruptStep`` propagates."""
        try:
            return self._outputs.apply(launched.sched, self.runner.collect(launched))
        except CorruptStep:
            queued, self._queued = self._queued, None
            self._outputs.drop(launched, queued)
            raise

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

    def speculation_stats(self) -> SpeculationStats | None:
        """What speculative decoding did so far (a copy); None when it is off."""
        return self.speculator.stats.snapshot() if self.speculator is not None else None

    def cache_stats(self) -> CacheStats:
        """Prefix-cache and pool counters (prompt vs cached tokens, checkpoints, pages in use)."""
        return self.cache.stats()

